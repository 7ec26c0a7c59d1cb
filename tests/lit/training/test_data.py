"""Byte corpus: file patterns, splits, document-bounded sequences, the memory-mapped cache, errors."""

import hashlib
import json
import math
import os
import pickle
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flexmoba.model import ModelConfig
from lit.training.data import (
    IGNORE_INDEX,
    ByteFilesData,
    CorpusError,
    ResumableSampler,
    default_root,
    list_files,
    package_of,
    split_of,
)


def write_corpus(root, sizes: dict[str, int]) -> None:
    """Files whose bytes say which file they come from (byte = file index + 1)."""
    for i, (rel, size) in enumerate(sorted(sizes.items())):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i + 1]) * size)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    sizes = {f"pkg/mod{i:02d}.py": 40 + 7 * i for i in range(40)}
    sizes["short.py"] = 5
    sizes["site-packages/skipped.py"] = 500
    sizes["notes.txt"] = 500
    write_corpus(root, sizes)
    return root


def make_data(corpus, tmp_path, **kwargs):
    kwargs = {"seq_len": 16, "batch_size": 2, "val_fraction": 0.2, "test_fraction": 0.1,
              "cache_dir": str(tmp_path / "cache"), **kwargs}
    data = ByteFilesData(root=str(corpus), **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def test_lists_only_python_outside_site_packages(corpus):
    names = [rel for rel, _ in list_files(str(corpus))]
    assert "notes.txt" not in names and not any("site-packages" in n for n in names)
    assert "pkg/mod00.py" in names and "short.py" in names


def test_sequences_never_cross_documents(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    for split in ("train", "val"):
        dataset = data.datasets[split]
        assert len(dataset) > 0
        for i in range(len(dataset)):
            inputs, targets = dataset[i]
            assert inputs.shape == targets.shape == (16,)
            assert len(set(inputs.tolist()) | set(targets.tolist())) == 1  # one file's byte only


def test_split_is_by_path_hash_and_disjoint(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    files = data._selected_files()
    for split, split_files in files.items():
        for rel, _ in split_files:
            assert split_of(rel, 0.2, 0.1) == split
    names = [set(rel for rel, _ in fs) for fs in files.values()]
    assert not (names[0] & names[1]) and not (names[0] & names[2]) and not (names[1] & names[2])


def test_short_documents_dropped_or_padded(corpus, tmp_path):
    dropped = make_data(corpus, tmp_path)
    all_files = [rel for fs in dropped._selected_files().values() for rel, _ in fs]
    assert "short.py" not in all_files
    padded = make_data(corpus, tmp_path, pad_short_docs=True)
    all_files = [rel for fs in padded._selected_files().values() for rel, _ in fs]
    assert "short.py" in all_files
    n_padded = 0
    for split in ("train", "val", "test"):
        for i in range(len(padded.datasets[split])):
            inputs, targets = padded.datasets[split][i]
            valid = targets != IGNORE_INDEX
            n = int(valid.sum())
            assert valid[:n].all() and not valid[n:].any()  # padding only at the end
            n_padded += n < 16
    assert n_padded > 0


def cache_files(tmp_path, suffix: str) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache").glob(f"*{suffix}"))


def test_cache_is_keyed_by_fingerprint(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    assert [name.split("-")[1] for name in cache_files(tmp_path, ".bin")] == [data.fingerprint]
    again = make_data(corpus, tmp_path)
    assert again.fingerprint == data.fingerprint and len(cache_files(tmp_path, ".bin")) == 1
    (corpus / "pkg" / "mod00.py").write_bytes(b"x" * 99)  # a size change is a new corpus
    changed = make_data(corpus, tmp_path)
    assert changed.fingerprint != data.fingerprint
    assert len(cache_files(tmp_path, ".bin")) == 2


def test_cache_follows_edits_and_folders_not_just_names_and_sizes(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    path = corpus / "pkg" / "mod00.py"
    path.write_bytes(b"y" * path.stat().st_size)  # same name and size, new bytes
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    edited = make_data(corpus, tmp_path)
    assert len(cache_files(tmp_path, ".bin")) == 2
    sequences = [edited.datasets[s][i][0] for s in ("train", "val", "test") for i in range(len(edited.datasets[s]))]
    assert any(bool((x == ord("y")).all()) for x in sequences)
    assert data.fingerprint == edited.fingerprint  # same corpus for a resumed run's check, new bytes cached
    twin = tmp_path / "twin"
    write_corpus(twin, {rel: size for rel, size in list_files(str(corpus), ["*"])})
    make_data(twin, tmp_path)
    assert len(cache_files(tmp_path, ".bin")) == 3


def test_cache_is_memory_mapped_and_shared(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    assert cache_files(tmp_path, ".json") == [name[:-4] + ".json" for name in cache_files(tmp_path, ".bin")]
    assert not list((tmp_path / "cache").glob("*tmp*"))
    tokens = data.datasets["train"].tokens
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8
    assert all(data.datasets[s].tokens is tokens for s in ("val", "test"))  # one file for every split
    (bin_path,) = (tmp_path / "cache").glob("*.bin")
    written = bin_path.stat().st_mtime_ns
    make_data(corpus, tmp_path)
    assert bin_path.stat().st_mtime_ns == written  # read, not written again


def test_cache_without_its_manifest_is_rebuilt(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    expected = [data.datasets["train"][i][0] for i in range(len(data.datasets["train"]))]
    (bin_path,) = (tmp_path / "cache").glob("*.bin")
    bin_path.with_suffix(".json").unlink()  # as if a writer died before its last rename
    bin_path.write_bytes(b"\xff" * bin_path.stat().st_size)
    rebuilt = make_data(corpus, tmp_path)
    assert all(torch.equal(rebuilt.datasets["train"][i][0], x) for i, x in enumerate(expected))


def test_datasets_pickle_by_file_name(corpus, tmp_path):
    """A spawned DataLoader worker gets the file's name and maps it again, not a copy of the bytes."""
    dataset = make_data(corpus, tmp_path).datasets["train"]
    payload = pickle.dumps(dataset)
    assert len(payload) < dataset.tokens.nbytes
    copy = pickle.loads(payload)
    assert isinstance(copy.tokens, np.memmap)
    assert all(torch.equal(a, b) for i in range(len(dataset)) for a, b in zip(copy[i], dataset[i], strict=True))


def test_patterns_choose_the_files(tmp_path):
    root = tmp_path / "notes"
    write_corpus(root, {"a.txt": 10, "deep/b.md": 10, "c.py": 10, ".git/d.txt": 10, "docs/e.md": 10})
    assert [rel for rel, _ in list_files(str(root), ["*.txt", "*.md"])] == ["a.txt", "deep/b.md", "docs/e.md"]
    assert [rel for rel, _ in list_files(str(root), ["docs/*.md"])] == ["docs/e.md"]
    assert [rel for rel, _ in list_files(str(root))] == ["c.py"]  # default: *.py


def test_text_files_long_documents_stay_whole(tmp_path):
    root = tmp_path / "text"
    write_corpus(root, {f"doc{i:02d}.txt": 16 * 10 + 1 for i in range(20)})
    data = make_data(root, tmp_path, patterns=["*.txt"], seq_len=16)
    for split in ("train", "val"):
        n_docs = len(data._selected_files()[split])
        assert len(data.datasets[split]) == 10 * n_docs  # every document cut into 10 sequences, none dropped
    assert data.datasets["train"][0][0].tolist() == data.datasets["train"][1][0].tolist()  # one file's bytes


def package_corpus(tmp_path):
    """Packages of files whose every byte names the file; sorted names: a.py < b.py < c.py."""
    root = tmp_path / "packages"
    files = {"top.py": 40}
    for i in range(24):
        package = f"pkg{i:02d}"
        files.update({f"{package}/c.py": 10, f"{package}/a.py": 20, f"{package}/b.py": 30, f"{package}/sub/d.py": 5})
    write_corpus(root, files)
    return root


def test_packages_are_their_files_concatenated_in_sorted_order(tmp_path):
    root = package_corpus(tmp_path)
    data = make_data(root, tmp_path, documents="packages", seq_len=8, val_fraction=0.25, test_fraction=0.0)
    tokens, offsets = data._load_or_build()["train"]
    names = [name for name, _ in data._selected_files()["train"]]
    assert "pkg00/sub/" not in names and "top.py" in names  # 5 bytes: too short; a root file is its own document
    for name, begin, end in zip(names, offsets[:-1], offsets[1:], strict=True):
        document = bytes(tokens[begin:end])
        if name != "top.py":
            assert [len(run) for run in split_runs(document)] == [20, 30, 10], name  # a.py, b.py, c.py
            files = sorted((root / name).glob("*.py"))
            assert document == b"".join(f.read_bytes() for f in files)


def split_runs(data: bytes) -> list[bytes]:
    """Maximal runs of one repeated byte."""
    runs, start = [], 0
    for i in range(1, len(data) + 1):
        if i == len(data) or data[i] != data[start]:
            runs.append(data[start:i])
            start = i
    return runs


def test_packages_split_by_the_package_folder_hash(tmp_path):
    root = package_corpus(tmp_path)
    data = make_data(root, tmp_path, documents="packages", seq_len=8, val_fraction=0.25, test_fraction=0.0)
    selected = data._selected_files()
    assert selected["val"] and selected["train"]
    for split, documents in selected.items():
        for name, size in documents:
            assert split_of(name, 0.25, 0.0) == split
            assert size == (60 if name.startswith("pkg") else 40)
    assert package_of("email/mime/text.py") == "email/mime/" and package_of("os.py") == "os.py"


def test_min_document_bytes_keeps_long_documents_whole(tmp_path):
    root = tmp_path / "text"
    sizes = {f"doc{i:02d}.txt": 100 + 50 * (i % 4) for i in range(40)}  # 100, 150, 200, 250 bytes
    write_corpus(root, sizes)
    data = make_data(root, tmp_path, patterns=["*.txt"], seq_len=16, min_document_bytes=200)
    kept = {name for split in ("train", "val", "test") for name, _ in data._selected_files()[split]}
    assert kept == {name for name, size in sizes.items() if size >= 200}
    for split in ("train", "val"):
        assert all(int(length) == 17 for length in data.datasets[split].lengths)  # every sequence reaches seq_len




def test_a_file_that_is_not_text_is_named_in_the_summary_not_taken_silently(corpus, tmp_path):
    (corpus / "pkg" / "mod07.py").write_bytes(np.random.default_rng(0).bytes(300))
    data = make_data(corpus, tmp_path)
    assert data.summary()[-1] == ("data: 1 file is not UTF-8 text (pkg/mod07.py), trained on as raw bytes; "
                                  "leave it out with --data.patterns or by moving it away")
    again = make_data(corpus, tmp_path)  # read from the cache: still said
    assert again.summary()[-1] == data.summary()[-1]
    (corpus / "pkg" / "mod07.py").write_text("x = 1\n" * 50)
    assert not any("UTF-8" in line for line in make_data(corpus, tmp_path).summary())


def test_max_files_slices_every_split(corpus, tmp_path):
    data = make_data(corpus, tmp_path, max_files=3)
    files = data._selected_files()
    assert len(files["train"]) == 3 and len(files["val"]) >= 1 and len(files["test"]) >= 1


def prepare_error(tmp_path, option: str, **kwargs) -> str:
    """The message of the error ``prepare_data`` raises; ``check_files`` raises the same, for ``option``."""
    data = ByteFilesData(cache_dir=str(tmp_path / "cache"), **{"seq_len": 16, **kwargs})
    with pytest.raises(CorpusError) as checked:
        data.check_files()
    assert checked.value.option == option
    with pytest.raises(ValueError) as error:
        data.prepare_data()
    assert str(error.value) == str(checked.value)
    return str(error.value)


def test_missing_root_names_the_parameter(tmp_path):
    message = prepare_error(tmp_path, "root", root=str(tmp_path / "absent"))
    assert "root=" in message and "does not exist" in message
    (tmp_path / "a_file").write_text("x")
    assert "not a directory" in prepare_error(tmp_path, "root", root=str(tmp_path / "a_file"))


def test_empty_root_names_the_parameter(tmp_path):
    (tmp_path / "empty" / ".git").mkdir(parents=True)
    (tmp_path / "empty" / ".git" / "HEAD").write_text("ref")
    message = prepare_error(tmp_path, "root", root=str(tmp_path / "empty"))
    assert "root=" in message and "empty" in message


def test_patterns_matching_nothing_name_the_parameter(tmp_path):
    write_corpus(tmp_path / "text", {"a.txt": 100})
    message = prepare_error(tmp_path, "patterns", root=str(tmp_path / "text"), patterns=["*.md"])
    assert "patterns=['*.md']" in message and "a.txt" in message


def test_all_files_too_short_says_how_many_were_skipped(tmp_path):
    write_corpus(tmp_path / "text", {"a.txt": 16, "b.txt": 5, "c.txt": 3})
    message = prepare_error(tmp_path, "seq_len", root=str(tmp_path / "text"), patterns=["*.txt"])
    assert "all 3 files" in message and "seq_len=16" in message and "pad_short_docs" in message


def test_empty_validation_split_names_val_fraction(tmp_path):
    sizes = {"a.txt": 100, "b.txt": 100, "c.txt": 100}
    assert all(split_of(rel, 0.01, 0.0) == "train" for rel in sizes)  # none hashes into val
    write_corpus(tmp_path / "text", sizes)
    message = prepare_error(tmp_path, "val_fraction", root=str(tmp_path / "text"), patterns=["*.txt"],
                            val_fraction=0.01, test_fraction=0.0)
    assert "the val split" in message and "3 long enough, 0 shorter ones skipped" in message


@pytest.mark.parametrize("patterns", [[], [""], [3]])
def test_bad_patterns_name_the_parameter(patterns):
    with pytest.raises(ValueError, match="patterns"):
        ByteFilesData(patterns=patterns)


@pytest.mark.parametrize("kwargs, name", [
    ({"seq_len": 0}, "seq_len"), ({"max_files": -1}, "max_files"), ({"val_fraction": 0.0}, "val_fraction"),
    ({"documents": "repos"}, "documents"), ({"min_document_bytes": 0}, "min_document_bytes"),
])
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ByteFilesData(**kwargs)


def test_default_corpus_is_the_stdlib(tmp_path):
    assert default_root() == sysconfig.get_paths()["stdlib"]
    data = ByteFilesData(seq_len=64, max_files=3, cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup("fit")
    inputs, targets = data.datasets["train"][0]
    assert inputs.dtype == torch.int64 and int(inputs.max()) < 256
    assert torch.equal(inputs[1:], targets[:-1])


def test_resumable_sampler_skips_consumed_samples():
    dataset = list(range(20))
    full = ResumableSampler(dataset, shuffle=True, seed=3)
    full.set_epoch(1)
    order = list(full)
    resumed = ResumableSampler(dataset, shuffle=True, seed=3)
    resumed.skip = (1, 6)
    resumed.set_epoch(1)
    assert list(resumed) == order[6:]
    assert list(resumed) == order  # the skip applies once
    assert len(resumed) == 20


# -- end to end: your own text through the CLI ------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()


def write_text_files(root: Path, n_files: int, n_words: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(n_files):
        words = rng.choice(WORDS, size=n_words)
        (root / f"note{i:03d}.txt").write_text(f"note {i}: " + " ".join(words) + ".\n")
    (root / "ignored.md").write_text("not a .txt file " * 100)


def tiny_model_config() -> ModelConfig:
    moba, tiny = (yaml.safe_load((CONFIGS / name).read_text()) for name in ("moba.yaml", "tiny.yaml"))
    return ModelConfig(**{**moba["model"]["config"], **tiny["model"]["config"]})


def last_row_with(rows: list[dict[str, str]], key: str) -> dict[str, float]:
    row = [r for r in rows if r.get(key)][-1]
    return {k: float(v) for k, v in row.items() if v}


@pytest.mark.slow
def test_fit_on_own_text_files_logs_bits_per_byte_grad_norm_and_throughput(tmp_path, flexmoba, metrics_of):
    text = tmp_path / "my text"
    write_text_files(text, n_files=40, n_words=400)
    root = tmp_path / "run"
    args = ["--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
            "--data.root", str(text), "--data.patterns", '["*.txt"]', "--data.val_fraction", "0.2",
            "--data.cache_dir", str(tmp_path / "cache")]
    flexmoba("fit", *args, cwd=tmp_path)
    rows = metrics_of(root)
    val = last_row_with(rows, "val/bpb")
    assert val["val/bpb"] == pytest.approx(val["val/loss"] / math.log(2), rel=1e-6)
    assert 0 < val["val/bpb"] < 8  # uniform guessing over bytes costs exactly 8 bits
    grad_norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(grad_norms) == 6 and all(0 < g < 1e3 for g in grad_norms)
    speed = last_row_with(rows, "throughput/train/device/flops_per_sec")
    flops_per_token = tiny_model_config().flops_per_token(128, training=True)
    assert speed["throughput/train/device/flops_per_sec"] / speed["throughput/train/device/items_per_sec"] == \
        pytest.approx(flops_per_token, rel=1e-6)
    (manifest,) = (tmp_path / "cache").glob("*.json")
    assert json.loads(manifest.read_text())["patterns"] == ["*.txt"]
    flexmoba("test", *args, "--ckpt_path", "last", cwd=tmp_path)
    test = last_row_with(metrics_of(root), "test/bpb")
    assert test["test/bpb"] == pytest.approx(test["test/loss"] / math.log(2), rel=1e-6)


def test_python_sources_keep_the_fingerprint_of_earlier_versions(corpus, tmp_path):
    """Checkpoints store the fingerprint: runs on .py files from before file patterns existed still resume."""
    data = make_data(corpus, tmp_path)
    files = {split: [[rel, size] for rel, size in fs] for split, fs in data._selected_files().items()}
    payload = {"python": sys.version, "options": {"val_fraction": 0.2, "test_fraction": 0.1}, "files": files}
    assert data.fingerprint == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    text = make_data(corpus, tmp_path, patterns=["*.py", "*.txt"])
    assert text.fingerprint != data.fingerprint
