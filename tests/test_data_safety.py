"""jaxgpt.data's run safety: one writer per shard directory, clear errors before anything is written (an
unusable --out, an empty corpus or split), the tokenizer recorded in the manifest and checked against the model,
and ids outside the vocabulary named by shard and offset, in training too."""

from __future__ import annotations

import json
import os
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
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, "mine.txt"]
    prepare([tmp_path / "short.txt"], out, val_fraction=0.0, verbose=False)  # no val split asked for: fine


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
    with pytest.raises(DataError, match="the shards' tokenizer has 50,257 ids but the model's vocab_size is 512"):
        check_shards_for_model(out, 512)
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


def handmade_shards(tmp_path: Path, bad_at: int, bad_id: int = 60_000) -> Path:
    """Shards as an older jaxgpt (no max_token) or another tool wrote them, holding one id outside GPT-2's."""
    out = tmp_path / "foreign"
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        ids = rng.integers(0, 50257, n)
        if split == "train":
            ids[bad_at] = bad_id
        write_shard(out, "foreign", split, 0, ids, {"source": "test"})
        header = out / f"foreign_{split}_000000.json"
        h = json.loads(header.read_text())
        del h["max_token"]
        header.write_text(json.dumps(h))
    return out


def test_an_id_outside_the_vocabulary_is_named_by_shard_and_offset(tmp_path):
    out = handmade_shards(tmp_path, bad_at=1234)
    check_shards_for_model(out, 50257)  # no header records it: the batches are checked
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


def test_training_on_such_shards_is_a_clear_error(tmp_path, capsys):
    from jaxgpt.train import main

    out = handmade_shards(tmp_path, bad_at=40)
    code = main(["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={out}", "--loader_mode=sequential",
                 f"--out_dir={tmp_path / 'run'}", "--max_steps=50", "--eval_interval=0", "--plot=false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "foreign_train_000000.bin: token id 60,000 at token offset 40 is outside" in err
    assert "Traceback" not in err
