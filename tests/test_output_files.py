"""inference_fleet/output_files.py: which `--report` paths are written through a descriptor opened when the option is
checked (simulate and verify alike), rather than by the commands' own rules for a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference_fleet.output_files import stream_target


def test_the_null_device_is_a_target_that_discards_the_report(tmp_path: Path) -> None:
    """`--report /dev/null` is an operator's way to discard the report: written through its own descriptor, whoever
    runs the command (no write permission on /dev is asked), and recognised as the device, not by name (a link to
    it). Old code: None, so each command applied its rules for a file (verify refused it as a device)."""
    link = tmp_path / "discard.json"
    link.symlink_to(os.devnull)
    for text in (os.devnull, str(link)):
        target = stream_target(text, "report.json")
        assert target is not None and target.fd is not None and target.discards and str(target) == text
        try:
            target.write('{"report": 1}\n')
        finally:
            target.close()
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["discard.json"]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full"])
def test_another_character_device_is_left_to_the_commands_rules_for_a_file(device: str) -> None:
    """Only the null device: any other device is the command's to judge (verify refuses one, report.py `unwritable`)."""
    if not Path(device).exists():
        pytest.skip(f"needs {device}")
    assert stream_target(device, "report.json") is None


def test_a_file_or_a_missing_path_is_no_stream(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text("{}")
    assert stream_target(str(tmp_path / "old.json"), "report.json") is None
    assert stream_target(str(tmp_path / "new.json"), "report.json") is None
