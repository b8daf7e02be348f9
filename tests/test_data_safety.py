"""jaxgpt.data's run safety: one writer per shard directory, clear errors before anything is written (an
unusable --out, an empty corpus or split), the tokenizer recorded in the manifest and checked against the model,
and ids outside the vocabulary named by shard and offset, in training too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data
from jaxgpt.data import DataError, DataLoader, check_shards_for_model, prepare, tokenizer_record, write_shard
from jaxgpt.rundir import LOCK_NAME, DirLock

REPO = Path(__file__).resolve().parent.parent
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "dickens.txt"
    p.write_text(TEXT)
    return p


def test_an_empty_corpus_or_split_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "shards"
    assert data.main(["--input", str(tmp_path / "empty.txt"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no text to train on" in err and "nothing was written" in err and "Traceback" not in err
    assert not out.exists()  # not even the directory

    (tmp_path / "short.txt").write_text("Hello there, world.")  # 5 tokens + the leading <|endoftext|>
    with pytest.raises(DataError, match="the train split would hold 0 token"):
        prepare([tmp_path / "short.txt"], out, val_fraction=0.9, verbose=False)
    with pytest.raises(DataError, match="the val split would hold 1 token.*--val-fraction 0 for no val split"):
        prepare([tmp_path / "short.txt"], out, val_fraction=0.1, verbose=False)
    assert not out.exists()
    out.mkdir()
    (out / "mine.txt").write_text("keep")  # an existing directory is left as it was
    with pytest.raises(DataError, match="the val split"):
        prepare([tmp_path / "short.txt"], out, val_fraction=0.1, verbose=False)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # exactly: not even a lock file
    prepare([tmp_path / "short.txt"], out, val_fraction=0.0, verbose=False)  # no val split asked for: fine


def ten_documents(tmp_path: Path, last: str = "") -> Path:
    """d0..d9; d9 (the one val document at val_fraction 0.1) holds ``last``: empty, an empty val split."""
    docs = tmp_path / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for i in range(9):
        (docs / f"d{i}.txt").write_text(f"Some words of document {i}. " * 30)
    (docs / "d9.txt").write_text(last)
    return docs


def snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``d``: its inode (replaced files get new ones) and its bytes."""
    return {str(p.relative_to(d)): (p.stat().st_ino, p.read_bytes()) for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_empty_val_split_after_train_shards_were_written_leaves_no_directory(tmp_path, capsys):
    """The train shards fill (shard size 100) long before the empty val document shows the split is empty."""
    docs = ten_documents(tmp_path)
    out = tmp_path / "fresh"
    assert data.main(["--input", str(docs / "*.txt"), "--out", str(out), "--shard-size", "100", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "the val split would hold 1 token(s)" in err and f"nothing was written to {out}" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_failed_prepare_leaves_an_existing_directory_exactly_as_it_was(tmp_path, capsys):
    out = tmp_path / "shards"
    good = ten_documents(tmp_path / "good", last="The val document. " * 20)
    common = ["--out", str(out), "--shard-size", "100", "--name", "corpus", "--quiet"]
    assert data.main(["--input", str(good / "*.txt"), *common]) == 0
    before = snapshot(out)
    assert len([f for f in before if f.endswith(".bin")]) > 5 and "manifest.json" in before
    bad = ten_documents(tmp_path / "bad")  # same name, other text, empty val split
    assert data.main(["--input", str(bad / "*.txt"), *common]) == 2
    assert snapshot(out) == before  # no shard replaced, the manifest still there
    err = capsys.readouterr().err
    assert f"nothing was written to {out}" in err and "Traceback" not in err
    loader = DataLoader(out, "train", 2, 16)
    loader.next_batch()
    with pytest.raises(DataError, match="the val split would hold 1"):
        prepare(sorted(bad.glob("*.txt")), out, shard_size=100, name="corpus", force=True, verbose=False)
    assert snapshot(out) == before


def test_an_interrupted_commit_is_refused_then_rebuilt(tmp_path, monkeypatch):
    """Killed while moving the new shards in: no manifest, a marker; readers refuse it, prepare rebuilds it."""
    out = tmp_path / "shards"
    docs = ten_documents(tmp_path, last="The val document. " * 20)
    prepare([docs / "*.txt"], out, shard_size=100, verbose=False)
    (docs / "d0.txt").write_text("Other words entirely. " * 40)  # a new input: the shards are rebuilt
    real_replace, calls = os.replace, []

    def dies_half_way(src, dst):
        if Path(dst).parent == out:  # not the staging directory's writes
            calls.append(dst)
        if len(calls) == 4:  # the marker, then one shard's .json and .bin, then this one
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        prepare([docs / "*.txt"], out, shard_size=100, verbose=False)
    monkeypatch.undo()
    names = {p.name for p in out.iterdir()}
    assert data.COMMIT_MARKER in names and "manifest.json" not in names
    assert not [n for n in names if n.startswith(".jaxgpt-staging.")]  # the staged files are removed
    assert not data.is_prepared(out)
    with pytest.raises(DataError, match="a preparation was interrupted while it moved new shards in"):
        DataLoader(out, "train", 2, 16)
    prepare([docs / "*.txt"], out, shard_size=100, verbose=False)
    assert data.COMMIT_MARKER not in {p.name for p in out.iterdir()} and data.is_prepared(out)
    first = data.find_shards(out, "train")[0]
    assert np.fromfile(first.path, dtype="<u2")[:5].tolist() == data.encode_document((docs / "d0.txt").read_text())[:5].tolist()


def test_a_killed_preparations_staging_directory_is_removed(tmp_path):
    out = tmp_path / "shards"
    leftover = out / ".jaxgpt-staging.99999.deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "corpus_train_000000.bin").write_bytes(b"\0" * 10)
    docs = ten_documents(tmp_path, last="The val document. " * 20)
    prepare([docs / "*.txt"], out, verbose=False)
    assert not leftover.exists() and data.is_prepared(out)


def test_unusable_out_and_a_second_writer(corpus, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    assert data.main(["--input", str(corpus), "--out", str(tmp_path / "file" / "shards"), "--quiet"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    out = tmp_path / "shards"
    with DirLock(out if out.mkdir() is None else out, what="shard directory", option="--out"):
        assert data.main(["--input", str(corpus), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"the shard directory is in use by process {os.getpid()}" in err and "Traceback" not in err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as root, permissions are not enforced
    assert data.main(["--input", str(corpus), "--out", str(tmp_path / "ro"), "--quiet"]) == 2
    assert "not writable" in capsys.readouterr().err


def test_the_manifest_records_the_tokenizer_and_the_model_is_checked(corpus, tmp_path):
    out = prepare([corpus], tmp_path / "shards", verbose=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == tokenizer_record() and manifest["tokenizer"]["vocab_size"] == 50257
    headers = [json.loads(p.read_text()) for p in sorted(out.glob("*_train_*.json"))]
    tokens = np.memmap(sorted(out.glob("*_train_*.bin"))[0], dtype="<u2", mode="r")
    assert headers[0]["max_token"] == int(tokens.max())
    check_shards_for_model(out, 50257)  # ours: fine
    with pytest.raises(DataError, match="the shards' tokenizer has 50,257 ids but the model's vocab_size is 512") as e:
        check_shards_for_model(out, 512)
    # both ways out: the model's vocabulary may be the one too small, or the shards from another tokenizer
    assert "train a model whose vocab_size exceeds every id in the shards (>= 50,257)" in str(e.value)
    assert "shards made with the model's own tokenizer (every id < 512" in str(e.value)
    assert "with this tokenizer" not in str(e.value)
    top = max(h["max_token"] for h in headers)
    no_record = {k: v for k, v in manifest.items() if k != "tokenizer"}
    (out / "manifest.json").write_text(json.dumps(no_record))  # then the shard headers' max_token still tell
    with pytest.raises(DataError, match=rf"_train_000000.bin: holds token id {top:,} >= the model's vocab_size {top:,}"):
        check_shards_for_model(out, top)

    for field, value, match in (("name", "cl100k_base", "made with tokenizer 'cl100k_base'"),
                                ("merges_sha256", "0" * 64, "its ids mean other text"),
                                ("vocab_size", 100277, "has 100,277 ids but the model's vocab_size is 50,257")):
        m = json.loads(json.dumps(manifest))
        m["tokenizer"][field] = value
        (out / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(DataError, match=match):
            check_shards_for_model(out, 50257)
    del m["tokenizer"]  # a manifest from before the record: loads, as before
    (out / "manifest.json").write_text(json.dumps(m))
    check_shards_for_model(out, 50257)


def handmade_shards(tmp_path: Path, bad_at: int, bad_id: int = 60_000, bad_split: str = "train") -> Path:
    """Shards as an older jaxgpt (no max_token) or another tool wrote them, holding one id outside GPT-2's."""
    out = tmp_path / "foreign"
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        ids = rng.integers(0, 50257, n)
        if split == bad_split:
            ids[bad_at] = bad_id
        write_shard(out, "foreign", split, 0, ids, {"source": "test"})
        header = out / f"foreign_{split}_000000.json"
        h = json.loads(header.read_text())
        del h["max_token"]
        header.write_text(json.dumps(h))
    return out


def test_an_id_outside_the_vocabulary_is_named_by_shard_and_offset(tmp_path):
    out = handmade_shards(tmp_path, bad_at=1234)
    check_shards_for_model(out, 50257, scan_max_tokens=0)  # no header records it, too big to read: batches checked
    loader = DataLoader(out, "train", 4, 64, mode="sequential")
    for _ in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        err = loader.token_error(x, y, 50257)
        if err is not None:
            break
    assert err is not None, "the bad id was never drawn"
    msg = str(err)
    assert "foreign_train_000000.bin: token id 60,000 at token offset 1,234 is outside" in msg
    assert "re-tokenize" in msg
    random = DataLoader(out, "train", 8, 64, mode="random", seed=3)
    for _ in range(500):
        x, y = random.next_batch()
        err = random.token_error(x, y, 50257)
        if err is not None:
            assert "token offset 1,234 " in str(err)  # in x, or in y (the next token): the same offset
            break
    else:
        pytest.fail("the random loader never drew the bad id")


@pytest.mark.parametrize("scanned", [True, False], ids=["read at set-up", "found in a batch"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_training_on_such_shards_is_a_clear_error(tmp_path, capsys, monkeypatch, split, scanned):
    """Small shards without max_token are read at set-up; larger ones are caught by the loaders' per-batch check
    (training and validation batches alike), before a step trains or evaluates on them."""
    from jaxgpt.data import shards
    from jaxgpt.train import main

    if not scanned:
        monkeypatch.setattr(shards, "SCAN_MAX_TOKENS", 0)
    out = handmade_shards(tmp_path, bad_at=40, bad_split=split)
    code = main(["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={out}", "--loader_mode=sequential",
                 f"--out_dir={tmp_path / 'run'}", "--max_steps=2", "--eval_interval=0", "--plot=false"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert f"foreign_{split}_000000.bin: token id 60,000 at token offset 40 is outside" in captured.err
    if scanned:
        assert "its header records no max_token, so the shard was read" in captured.err  # at set-up
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    else:
        assert f"(found in batch 1 of the {split} split" in captured.err
    assert "Traceback" not in captured.err and "nan" not in captured.out + captured.err


def test_val_ids_outside_the_vocabulary_are_caught_before_training(tmp_path):
    """Only train batches went through token_error: an id of 60000 in an old val shard gave `val loss nan`."""
    out = handmade_shards(tmp_path, bad_at=777, bad_split="val")
    with pytest.raises(DataError) as e:  # the val shard is small: read whole
        check_shards_for_model(out, 50257)
    assert ("foreign_val_000000.bin: token id 60,000 at token offset 777 is outside the model's vocabulary "
            "[0, 50,257) (the val split; its header records no max_token") in str(e.value)
    assert "vocab_size exceeds every id in the shards (>= 60,001)" in str(e.value)
    check_shards_for_model(out, 60_001)  # a model whose vocabulary covers it: fine
    check_shards_for_model(out, 50257, splits=["train"])
    check_shards_for_model(out, 50257, scan_max_tokens=999)  # 1000 tokens: not read


@pytest.mark.parametrize("mode", ["sequential", "random"])
def test_a_loader_with_vocab_size_checks_every_batch(tmp_path, mode):
    out = handmade_shards(tmp_path, bad_at=500, bad_split="val")
    plain = DataLoader(out, "val", 2, 64, mode=mode, seed=1)
    checked = DataLoader(out, "val", 2, 64, mode=mode, seed=1, vocab_size=50257)
    for _ in range(300):
        x, y = plain.next_batch()  # without vocab_size: as before, no check
        if plain.token_error(x, y, 50257) is None:
            np.testing.assert_array_equal(checked.next_batch()[0], x)  # a valid batch: the same rows
            continue
        with pytest.raises(DataError, match=r"foreign_val_000000.bin: token id 60,000 at token offset 500 is outside "
                                            r"the model's vocabulary \[0, 50,257\) \(found in batch \d+ of the val "
                                            r"split"):
            checked.next_batch()
        break
    else:
        pytest.fail("the bad id was never drawn")
    skipping = DataLoader(out, "val", 2, 64, mode=mode, seed=1, vocab_size=50257)
    skipping.skip(plain.step)  # past the bad batch without a check: skipping is how a run steps over bad data
    assert skipping.state_dict() == plain.state_dict()
    np.testing.assert_array_equal(skipping.next_batch()[0], plain.next_batch()[0])
    checked.vocab_size = None  # the attribute turns it off (and on)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(DataError, match="DataLoader.vocab_size"):
            DataLoader(out, "val", 2, 64, vocab_size=bad)


def test_ensure_prepared_waits_for_another_process_preparing_the_directory(tmp_path, capsys, monkeypatch):
    """Two trainings on one fresh data_dir: the second waits for the first's preparation and uses its shards
    (it was refused with "shard directory is in use ... choose another --out", an option training lacks)."""
    docs = ten_documents(tmp_path, last="The val document. " * 20)
    d = tmp_path / "data"
    code = ("import importlib, sys, time; p = importlib.import_module('jaxgpt.data.prepare'); build = p._build_shards\n"
            "def slow(*a, **k):\n    print('building', flush=True); time.sleep(1.5); return build(*a, **k)\n"
            "p._build_shards = slow; p.ensure_prepared([sys.argv[1]], sys.argv[2], verbose=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(docs / "*.txt"), str(d)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building"

        def never(*a, **k):
            raise AssertionError("prepared twice")

        monkeypatch.setattr(sys.modules["jaxgpt.data.prepare"], "_build_shards", never)
        assert data.ensure_prepared([docs / "*.txt"], d, wait_s=60) == d
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    out = capsys.readouterr().out
    assert f"the shard directory is locked by process {proc.pid}" in out and "waiting for it to finish" in out
    assert "prepared by the process this one waited for; using its shards" in out
    DataLoader(d, "val", 1, 8).next_batch()
    assert data.ensure_prepared(["no/such/*.txt"], d) == d  # prepared: used as it is, the source not even read


def test_ensure_prepared_errors_name_the_callers_option(tmp_path, corpus):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError) as e:
        data.ensure_prepared([corpus], tmp_path / "afile" / "d", verbose=False)
    assert "data_dir '" in str(e.value) and "is a file, not a directory" in str(e.value)
    assert str(e.value).endswith("choose another data_dir") and "--out" not in str(e.value)
    d = tmp_path / "d"
    with DirLock(d if d.mkdir() is None else d, what="shard directory", option="data_dir"):
        with pytest.raises(DataError, match=r"data_dir '.*': the shard directory is in use by process \d+ .*\(still, "
                                            r"after waiting 0.3 s\).*choose another data_dir"):
            data.ensure_prepared([corpus], d, wait_s=0.3, verbose=False)
    (tmp_path / "short.txt").write_text("Hello there, world.")
    with pytest.raises(DataError, match=r"the val split would hold 1 token.*python -m jaxgpt.data \.\.\. --out .*/d2 "
                                        r"--val-fraction F"):
        data.ensure_prepared([tmp_path / "short.txt"], tmp_path / "d2", verbose=False)
    assert not (tmp_path / "d2").exists()
    data.ensure_prepared([corpus], d, verbose=False)  # and when it works: the manifest and shards
    assert data.is_prepared(d) and (d / "manifest.json").exists()
