from launcher.ui.cli import entry

entry()
