"""Byte corpus: splits, document-bounded sequences, caching, errors."""

import sysconfig

import pytest
import torch

from lit.data import (
    IGNORE_INDEX,
    PythonSourceData,
    ResumableSampler,
    default_corpus_dir,
    list_python_files,
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
    data = PythonSourceData(corpus_dir=str(corpus), **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def test_lists_only_python_outside_site_packages(corpus):
    names = [rel for rel, _ in list_python_files(str(corpus))]
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


def test_cache_is_keyed_by_fingerprint(corpus, tmp_path):
    data = make_data(corpus, tmp_path)
    cache_files = sorted(p.name for p in (tmp_path / "cache").glob("*.npz"))
    assert cache_files == [f"corpus-{data.fingerprint}.npz"]
    again = make_data(corpus, tmp_path)
    assert again.fingerprint == data.fingerprint
    (corpus / "pkg" / "mod00.py").write_bytes(b"x" * 99)  # a size change is a new corpus
    changed = make_data(corpus, tmp_path)
    assert changed.fingerprint != data.fingerprint
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_max_files_slices_every_split(corpus, tmp_path):
    data = make_data(corpus, tmp_path, max_files=3)
    files = data._selected_files()
    assert len(files["train"]) == 3 and len(files["val"]) >= 1 and len(files["test"]) >= 1


@pytest.mark.parametrize("make_dir", [False, True])
def test_missing_or_empty_corpus_names_the_parameter(tmp_path, make_dir):
    corpus = tmp_path / "nothing"
    if make_dir:
        corpus.mkdir()
    data = PythonSourceData(corpus_dir=str(corpus), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="corpus_dir"):
        data.prepare_data()


@pytest.mark.parametrize("kwargs, name", [
    ({"seq_len": 0}, "seq_len"), ({"max_files": -1}, "max_files"), ({"val_fraction": 0.0}, "val_fraction"),
])
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PythonSourceData(**kwargs)


def test_default_corpus_is_the_stdlib(tmp_path):
    assert default_corpus_dir() == sysconfig.get_paths()["stdlib"]
    data = PythonSourceData(seq_len=64, max_files=3, cache_dir=str(tmp_path / "cache"))
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
