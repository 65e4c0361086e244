"""`kvtier bench storage` at smoke-test sizes over the file backend: each part, its JSON, its checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier import cli
from kvtier.bench import storage, storage_codec, storage_stores, storage_throughput
from kvtier.cli import args as cli_args
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.storage.values import PageCodec

CPU = torch.device("cpu")


def _bench(tmp_path: Path, *parts: storage.Part, **kw) -> storage.StorageBench:
    """Smoke-test sizes of `parts` over the file backend, with `kw` replaced."""
    base = storage.StorageBench(tmp_path, parts, backends=("file",), specs=("smollm2",), page_sizes=(16,))
    return replace(base.quick(), **kw)


def _point(spec_name: str = "smollm2", page_size: int = 16, pages: int = 6) -> storage_throughput.Point:
    return storage_throughput.Point(spec_name, storage.spec_of(spec_name, page_size), pages, "layer_first")


def test_the_cli_choices_match_what_they_name() -> None:
    assert tuple(p.value for p in storage.Part) == cli_args.STORAGE_PARTS
    assert cli_args.STORAGE_BACKENDS == storage.BACKENDS
    assert cli_args.STORAGE_SPECS == storage.SPECS


def test_quick_throughput_through_the_cli_writes_its_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "storage.json"
    argv = ["bench", "storage", "--quick", "--parts", "throughput", "--backends", "file"]
    argv += ["--page-sizes", "16,64", "--dir", str(tmp_path), "--json", str(out)]
    assert cli.main(argv) == 0
    shown = capsys.readouterr().out
    assert "Page put and get" in shown and "identical" in shown
    report = json.loads(out.read_text())
    assert report["meta"]["page_cache"] == "warm" and report["meta"]["tier"]["workers"] >= 1
    rows = report["throughput"]
    assert [(r["setup"], r["page_size"]) for r in rows] == [
        (s, ps) for s in ("smollm2", "deepseek-v3") for ps in (16, 64)
    ]
    for r in rows:
        assert r["identical"] and r["failure"] == "" and r["pages"] >= 4
        for op in ("put", "get"):
            assert r[f"kvtier_{op}_gbps"] > 0 and r[f"raw_{op}_gbps"] > 0
            assert r[f"{op}_ratio"] == pytest.approx(r[f"kvtier_{op}_gbps"] / r[f"raw_{op}_gbps"], rel=0.02)
    assert list(tmp_path.iterdir()) == [out]  # the stores are gone


def test_values_are_as_long_as_kvtier_writes_them() -> None:
    spec = storage.spec_of("deepseek-v3", 64)
    assert spec.page_size * spec.bytes_per_token() == 64 * 61 * 576 * 2
    codec = PageCodec(spec, storage_throughput.Fingerprint(bytes(16)))
    assert storage_throughput.pages_for(spec, 1 << 30, 4) * codec.value_bytes >= 1 << 30
    assert storage_throughput.pages_for(spec, 1, 4) == 4


def test_a_value_corrupted_in_the_store_fails_the_check(tmp_path: Path, monkeypatch) -> None:
    """A byte flipped in every stored value: kvtier refuses the pages, and the point is not timed."""
    real = PageCodec.encode

    def corrupt(self, page_hash, views):
        header, *payload = real(self, page_hash, views)
        blob = bytearray(b"".join(bytes(c) for c in payload))
        blob[-1] ^= 0xFF
        return [header, bytes(blob)]

    monkeypatch.setattr(PageCodec, "encode", corrupt)
    row = storage_throughput.measure(storage_stores.FileSide(tmp_path), _point(), 1, False, 0)
    assert not row.identical and row.failure.startswith("kvtier get: 0 of 6 pages arrived")
    assert "'checksum': 1" in row.failure
    assert row.kvtier_get_gbps is None and row.get_ratio is None


def test_bytes_the_tier_did_not_write_fail_the_check(tmp_path: Path, monkeypatch) -> None:
    """A get that claims every page but writes no payload leaves the poison: the byte comparison sees it."""
    from kvtier.storage.file import FileBackend

    real = FileBackend.get_into

    def header_only(self, keys, buffers):
        return real(self, keys, [[b[0], *(memoryview(bytearray(len(v))) for v in b[1:])] for b in buffers])

    monkeypatch.setattr(FileBackend, "get_into", header_only)
    monkeypatch.setattr(PageCodec, "check", lambda self, h, n, bufs: None)
    row = storage_throughput.measure(storage_stores.FileSide(tmp_path), _point(), 1, False, 0)
    assert not row.identical and row.failure == "kvtier get: page 0 of 6 differs from the bytes put"


def test_a_raw_value_read_short_fails_the_check(tmp_path: Path, monkeypatch) -> None:
    real = storage_stores.RawFiles.get
    monkeypatch.setattr(
        storage_stores.RawFiles, "get", lambda self, idx, dst, check=False: real(self, idx[:-1], dst)
    )
    row = storage_throughput.measure(storage_stores.FileSide(tmp_path), _point(pages=20), 1, False, 0)
    assert not row.identical and row.failure == "raw get: value 15 of 20 differs from the bytes put"


def _tiny_kv(tokens: int, device: torch.device, progress) -> storage_codec.KV:
    model = tiny_llama(max_positions=1024)
    ids = np.random.default_rng(1).integers(0, 256, tokens).tolist()
    with Engine(model, device_tokens=tokens + 64, host_tokens=tokens + 64) as eng:
        return storage_codec.kv_of(eng, ids, "tiny")


def test_compression_rows_round_trip_every_codec(tmp_path: Path) -> None:
    report = storage.run(_bench(tmp_path, storage.Part.COMPRESSION, page_sizes=(16, 64)), kv=_tiny_kv)
    rows = json.loads(json.dumps(report))["compression"]
    assert [(r["page_size"], r["compression"]) for r in rows] == [
        (ps, c) for ps in (16, 64) for c in ("none", "lz4", "zstd")
    ]
    for r in rows:
        assert r["identical"] and r["kv"] == "tiny" and r["dtype"] == "torch.float32"
        assert r["pages"] == 256 // r["page_size"] and r["page_bytes"] == r["page_size"] * 2 * 2 * 2 * 16 * 4
        assert 0 < r["ratio"] <= 1 and r["encode_gbps"] > 0 and r["decode_gbps"] > 0
    assert {r["ratio"] for r in rows if r["compression"] == "none"} == {1.0}


def test_the_page_layout_is_the_payload_of_kvtier_values() -> None:
    """`pages_of` lays out each page as the host pool's `page_views` do (buffer, layer, rows)."""
    kv = _tiny_kv(64, CPU, None)
    pages = storage_codec.pages_of(kv, 16)
    k0, v1 = kv.rows["k"][0], kv.rows["v"][1]  # [64, row_bytes] each
    row = k0.shape[1]
    assert pages.shape == (4, 16 * row * 4)
    assert np.array_equal(pages[2, : 16 * row], k0[32:48].ravel())
    assert np.array_equal(pages[2, 3 * 16 * row :], v1[32:48].ravel())


def test_a_wrong_decode_fails_the_compression_check(tmp_path: Path, monkeypatch) -> None:
    real = PageCodec._unplane

    def off_by_one(self, planes, views):
        real(self, planes, views)
        views[-1][-1] ^= 1

    monkeypatch.setattr(PageCodec, "_unplane", off_by_one)
    report = storage.run(_bench(tmp_path, storage.Part.COMPRESSION), kv=_tiny_kv)
    by = {r["compression"]: r for r in report["compression"]}
    assert by["none"]["identical"]
    assert not by["lz4"]["identical"] and by["lz4"]["note"] == "decoded bytes differ from the KV"


def test_ttft_rows_come_back_from_storage_after_a_restart(tmp_path: Path) -> None:
    """A prefix past the context is cut to the longest that fits (as `bench served` does) and measured."""
    bench = _bench(tmp_path, storage.Part.TTFT, tokens=(256, 1024), miss_repeats=2)
    report = storage.run(bench, make_model=lambda setup, device: tiny_llama(max_positions=512))
    rows = json.loads(json.dumps(report))["ttft"]
    assert [r["prefix_tokens"] for r in rows] == [256, 448]
    for r in rows:
        n = r["prefix_tokens"]
        ps = r["page_size"]
        assert ps == 64  # the engine's page with a storage tier
        hit = (n + 15) // ps * ps  # the prompt's whole pages but its last token, from storage
        assert r["storage_hit_tokens"] == hit and r["storage_values_read"] == hit // ps
        assert r["storage_bytes_read"] > r["kv_bytes"] == n // ps * r["value_bytes"]
        assert r["same_first_token"] and r["page_cache"] == "warm"
        assert min(r["ttft_miss_s"], r["ttft_host_hit_s"], r["ttft_storage_hit_s"], r["storage_read_s"]) > 0
        assert r["raw_read_gbps"] > 0 and r["read_vs_raw"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_bad_plan_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'backends': \['s3'\]"):
        storage.StorageBench(tmp_path, backends=("file", "s3"))
    with pytest.raises(ConfigError, match=r"'page_sizes': \[0\]"):
        storage.StorageBench(tmp_path, page_sizes=(16, 0))
    assert list(tmp_path.iterdir()) == []
