"""``--set`` errors speak the spec's language (YAML, field paths) and show the right form."""

from __future__ import annotations

import pytest

from launcher.errors import SpecError
from launcher.spec.model import load_job
from tests.conftest import REPO, launch

SPEC = REPO / "jobs" / "matmul_scaling.yaml"


def _problems(*sets: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_job(SPEC, list(sets))
    return list(caught.value.problems)


def test_an_unclosed_list_is_named_as_yaml_with_the_right_form():
    (line,) = _problems("scaling.workers=[1,2")
    assert line == ("--set scaling.workers=[1,2: the value is not valid YAML: its list is not closed (no ']' for its '['); "
                    "quote the whole of it for the shell, e.g. --set 'scaling.workers=[1, 2]'")  # fmt: skip
    assert "tuple" not in line
    (mapping,) = _problems("params={iters: 3")
    assert "its mapping is not closed (no '}' for its '{')" in mapping and "--set 'params={name: value}'" in mapping


def test_spaces_around_the_equals_sign_are_allowed_as_yaml_allows_them_around_its_colon():
    assert load_job(SPEC, ["params.iters = 5"]).spec.params["iters"] == 5
    assert load_job(SPEC, ["scaling.workers=[1, 2]"]).spec.scaling.workers == (1, 2)


@pytest.mark.parametrize(
    ("item", "said"),
    [("params.iters", "--set params.iters: no '=' in it; "), ("=5", "--set =5: no field before the '='; "),
     ("params..iters=5", "--set params..iters=5: 'params..iters' is not a field path (names of letters, digits and _, joined by single dots); ")],
)  # fmt: skip
def test_what_is_not_field_equals_value_says_what_is_wrong_and_the_right_form(item, said):
    (line,) = _problems(item)
    assert line == said + "expected FIELD=VALUE: a field of the spec as a dotted path and its value as YAML, e.g. --set params.iters=50"


def test_the_cli_says_it_in_one_line_exit_2():
    done = launch(str(SPEC), "--dry-run", "--set", "scaling.workers=[1,2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--set 'scaling.workers=[1, 2]'" in done.stderr and "valid tuple" not in done.stderr, done.stderr


def test_text_that_is_not_yaml_is_kept_as_written():
    """Only a list or mapping left open is an error: other text (quotes, shell metacharacters and
    all) that YAML cannot read is the value, as typed."""
    from launcher.spec.model import load_job
    from tests.conftest import REPO

    text = "x; $(id) `id` 'q' \\'r\\' \"d\""
    job = load_job(REPO / "jobs" / "matmul_scaling.yaml", [f"env.NOTE={text!r}"])
    assert job.spec.env["NOTE"] == repr(text)
