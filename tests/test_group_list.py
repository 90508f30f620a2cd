"""The groups file's format and the change the coordinator applies when it changes (pure)."""

from __future__ import annotations

import pytest

from lockstep.coordinator.config import parse_config
from lockstep.coordinator.group_list import GroupsDiff, diff_groups, format_group_list, parse_group_list

G0 = ("h0:1", "h0:2")
G1 = ("h1:1", "h1:2")


def test_one_group_a_line_with_comments_and_blank_lines():
    text = "# ranks in rank order\n\ng0=h0:1, h0:2\n  g1 = h1:1,h1:2  \n"
    assert parse_group_list(text) == {"g0": G0, "g1": G1}


def test_a_lockstep_groups_string_is_a_valid_file():
    assert parse_group_list("g0=h0:1,h0:2;g1=h1:1,h1:2") == {"g0": G0, "g1": G1}


def test_format_round_trips_in_order():
    groups = {"g1": G1, "g0": G0}
    assert list(parse_group_list(format_group_list(groups))) == ["g1", "g0"]
    assert parse_group_list(format_group_list(groups)) == groups


@pytest.mark.parametrize("text", ["g0", "g0=", "=h:1", "g0=h:1\ng0=h:2", "g0=h:1;g1"])
def test_bad_entries_are_refused(text):
    with pytest.raises(ValueError):
        parse_group_list(text)


@pytest.mark.parametrize(("text", "words"), [
    ("g0=h:1\ng1=h:2,h:1", "h:1 is listed for groups 'g0' and 'g1'"),
    ("g0=h:1,h:1", "h:1 is listed twice in group 'g0'"),
    ("g3=127.0.0.1:24011 # extra", "'127.0.0.1:24011 # extra' is not HOST:PORT"),
    ("g0=h", "'h' is not HOST:PORT"),
    ("g0=h:0", "'h:0' is not HOST:PORT"),
    ("g0=h:70000", "'h:70000' is not HOST:PORT"),
    ("g0=:50051", "':50051' is not HOST:PORT"),
])
def test_a_rank_in_two_groups_or_an_address_that_is_no_address_is_refused(text, words):
    """Found by a fault-finding helper: one rank listed for two groups was applied, and the two groups took its one
    Step stream from each other about 250 times a second, for ever; an address with a comment after it was
    applied, and its group never served. A rank serves one group, at one HOST:PORT."""
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_group_list(text)
    assert parse_group_list("g0=[::1]:50051,demo-g0-0.demo-g0.ml.svc.cluster.local:50051") == {
        "g0": ("[::1]:50051", "demo-g0-0.demo-g0.ml.svc.cluster.local:50051")}


def test_groups_given_as_several_flags_are_checked_together(capsys):
    """--group g0=... --group g0=... (or the same rank in two flags) is refused as one list would be."""
    for argv in (["--group", "g0=h:1", "--group", "g0=h:2"], ["--group", "g0=h:1", "--group", "g1=h:1"]):
        with pytest.raises(SystemExit):
            parse_config(argv, env={})
        assert "listed" in capsys.readouterr().err


def test_empty_text_is_no_group():
    assert parse_group_list("") == {} and parse_group_list("# nothing\n\n") == {}


def test_diff_added_removed_changed():
    running = {"g0": G0, "g1": G1, "g2": ("h2:1",)}
    listed = {"g0": G0, "g2": ("h2:9",), "g3": ("h3:1",)}
    diff = diff_groups(running, listed)
    assert diff == GroupsDiff(added={"g3": ("h3:1",)}, removed=("g1",), changed={"g2": ("h2:9",)})
    assert diff


def test_same_list_is_no_change_and_order_does_not_matter():
    assert not diff_groups({"g0": G0, "g1": G1}, {"g1": G1, "g0": G0})


def test_rank_order_is_part_of_the_addresses():
    assert diff_groups({"g0": G0}, {"g0": tuple(reversed(G0))}).changed == {"g0": ("h0:2", "h0:1")}


def test_config_reads_the_groups_file(tmp_path):
    path = tmp_path / "groups"
    path.write_text("g0=h0:1,h0:2\ng1=h1:1,h1:2\n")
    config = parse_config([], env={"LOCKSTEP_GROUPS_FILE": str(path)})
    assert config.groups == {"g0": G0, "g1": G1} and config.groups_file == str(path)
    assert parse_config(["--groups-file", str(path)], env={}).groups_file == str(path)


@pytest.mark.parametrize("argv,env", [
    (["--group", "g0=h:1"], {"LOCKSTEP_GROUPS_FILE": "FILE"}),
    ([], {"LOCKSTEP_GROUPS_FILE": "FILE", "LOCKSTEP_GROUPS": "g0=h:1"}),
    (["--groups-file", "MISSING"], {}),
    (["--groups-file", "EMPTY"], {}),
])
def test_config_refuses_two_sources_and_an_unreadable_or_empty_file(tmp_path, capsys, argv, env):
    (tmp_path / "FILE").write_text("g0=h:1\n")
    (tmp_path / "EMPTY").write_text("# no group yet\n")
    fix = lambda v: str(tmp_path / v) if v in ("FILE", "MISSING", "EMPTY") else v  # noqa: E731
    with pytest.raises(SystemExit):
        parse_config([fix(a) for a in argv], env={k: fix(v) for k, v in env.items()})
    assert "groups" in capsys.readouterr().err
