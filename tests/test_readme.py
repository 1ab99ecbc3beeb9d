"""The README stays true: its fleet reference is the one generated from the config models."""

from __future__ import annotations

from pathlib import Path

from inference_fleet.reference import BEGIN, END, markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_fleet_reference_matches_the_models() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == markdown(), "run `python -m inference_fleet reference` and paste it into README.md"


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "make synth" in text and "make test" in text
