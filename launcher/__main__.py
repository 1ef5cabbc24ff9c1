from launcher.cli import entry

entry()
