"""Long-range corpus: copies are exact at their recorded places, far from their sources, seeded, cached once."""

import numpy as np
import pytest
import torch

from lit.training import long_range
from lit.training.data import ByteFilesData, CorpusError
from lit.training.long_range import LongRangeData
from lit.training.metrics import repeat_span_losses

SEQ_LEN = 512
SPAN = (16, 48)
DISTANCES = [64, 128, 256]  # the default bins at seq_len 512: seq_len / 8, / 4, / 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, random_files):
    """Files of random bytes, so the files themselves repeat nothing a test could mistake for a copy."""
    return random_files(tmp_path_factory.mktemp("random-corpus"), 12, 3 * SEQ_LEN + 40)


def make(cls, corpus, cache, **kwargs):
    data = cls(root=str(corpus), seq_len=SEQ_LEN, batch_size=2, val_fraction=0.25, test_fraction=0.0,
               cache_dir=str(cache), **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def long_range_data(corpus, cache, **kwargs):
    return make(LongRangeData, corpus, cache, **{"repeat_span_bytes": SPAN, "repeat_share": 0.3, **kwargs})


def sequences(data, split):
    dataset = data.datasets[split]
    return [(i, int(first), int(n)) for i, (first, n) in enumerate(zip(dataset.starts, dataset.lengths, strict=True))]


def test_copies_are_the_original_source_bytes_and_nothing_else_changes(corpus, tmp_path):
    plain = np.asarray(make(ByteFilesData, corpus, tmp_path / "plain").datasets["train"].tokens)
    data = long_range_data(corpus, tmp_path / "repeats")
    tokens = np.asarray(data.datasets["train"].tokens)
    assert tokens.shape == plain.shape
    copied = np.zeros(len(tokens), dtype=bool)
    n_repeats = 0
    for split in ("train", "val"):
        for index, first, _ in sequences(data, split):
            for start, length, source in data.repeats_of(split, index):
                window = slice(first + start, first + start + length)
                assert np.array_equal(tokens[window], plain[first + source : first + source + length])
                assert not np.array_equal(plain[window], plain[first + source : first + source + length])
                copied[window] = True
                n_repeats += 1
    assert n_repeats == len(data.repeats) > 0  # every recorded copy belongs to one sequence
    assert np.array_equal(tokens[~copied], plain[~copied])


def test_random_sources_are_printable_new_bytes_and_their_copies_match(corpus, tmp_path):
    plain = np.asarray(make(ByteFilesData, corpus, tmp_path / "plain").datasets["train"].tokens)
    data = long_range_data(corpus, tmp_path / "random", repeat_content="random")
    tokens = np.asarray(data.datasets["train"].tokens)
    touched = np.zeros(len(tokens), dtype=bool)
    for split in ("train", "val"):
        for index, first, _ in sequences(data, split):
            for start, length, source in data.repeats_of(split, index):
                copy = slice(first + start, first + start + length)
                origin = slice(first + source, first + source + length)
                assert np.array_equal(tokens[copy], tokens[origin])
                assert ((tokens[origin] >= 32) & (tokens[origin] < 127)).all()
                assert (tokens[origin] != plain[origin]).mean() > 0.5  # the corpus is random bytes 0..255
                touched[copy] = touched[origin] = True
    assert np.array_equal(tokens[~touched], plain[~touched])


def test_distances_fall_in_the_bins_and_spans_inside_the_targets(corpus, tmp_path):
    data = long_range_data(corpus, tmp_path)
    assert data.plan.distances == tuple(DISTANCES)  # the default bins scale with seq_len
    bins = np.zeros(len(DISTANCES), dtype=int)
    for split in ("train", "val"):
        for index, _, n in sequences(data, split):
            repeats = data.repeats_of(split, index)
            starts, lengths, sources = repeats.T
            assert ((SPAN[0] <= lengths) & (lengths <= SPAN[1])).all()
            assert (sources >= 1).all() and (starts + lengths <= n - 1).all()  # every byte is a target
            assert (starts - sources >= DISTANCES[0]).all()
            bins += np.bincount(np.searchsorted(DISTANCES, starts - sources, side="right") - 1, minlength=3)
            copies = np.zeros(n, dtype=bool)
            for start, length, _ in repeats:
                assert not copies[start : start + length].any()  # copies never overlap
                copies[start : start + length] = True
            for _, length, source in repeats:
                assert not copies[source : source + length].any()  # a source is never a copy
            assert copies.sum() >= 0.3 * n
    assert (bins > 0).all()


def test_placement_is_seeded_and_independent_of_the_training_seed(corpus, tmp_path):
    first = long_range_data(corpus, tmp_path / "a", seed=1)
    again = long_range_data(corpus, tmp_path / "b", seed=2)
    other = long_range_data(corpus, tmp_path / "c", repeat_seed=1)
    assert np.array_equal(first.repeats, again.repeats)
    assert np.array_equal(np.asarray(first.datasets["train"].tokens), np.asarray(again.datasets["train"].tokens))
    assert not np.array_equal(first.repeats, other.repeats)
    assert first.fingerprint == again.fingerprint != other.fingerprint


def test_cache_is_written_once(corpus, tmp_path, monkeypatch):
    data = long_range_data(corpus, tmp_path)
    files = sorted(tmp_path.glob("repeats-*"))
    assert sorted(p.name.split(".", 1)[1] for p in files) == ["bin", "json", "npy", "repeats.npy"]
    written = {p: p.stat().st_mtime_ns for p in files}

    def fail(*args, **kwargs):
        raise AssertionError("the cache was written again")

    monkeypatch.setattr(long_range, "write_repeats", fail)
    reread = long_range_data(corpus, tmp_path)
    assert np.array_equal(reread.repeats, data.repeats)
    assert {p: p.stat().st_mtime_ns for p in sorted(tmp_path.glob("repeats-*"))} == written


def test_recorded_places_line_up_with_the_targets(corpus, tmp_path):
    """A loss that is the target byte itself is the same on a copy as on its source only if the
    recorded places point at the targets that predict those bytes (random bytes: any shift shows)."""
    data = long_range_data(corpus, tmp_path)
    batch = [data.datasets["val"][i] for i in range(2)]
    targets = torch.stack([target for _, target in batch])
    repeats = [data.repeats_of("val", i) for i in range(2)]
    result = repeat_span_losses(targets.double(), targets, repeats, edges=DISTANCES[1:]).means()
    assert result["count"] == sum(int(r[:, 1].sum()) for r in repeats) > 0
    assert result["copy"] == result["source"] and result["gap"] == 0
    shifted = [r + np.array([1, 0, 0]) for r in repeats]
    assert repeat_span_losses(targets.double(), targets, shifted).means()["gap"] != 0


@pytest.mark.parametrize(("options", "option"), [
    ({"repeat_span_bytes": (16, 400)}, "repeat_distances"),  # a 400-byte copy 256 bytes on leaves 512 bytes
    ({"repeat_share": 0.6}, "repeat_share"),
    ({"repeat_distances": [128, 64]}, "repeat_distances"),
    ({"repeat_span_bytes": (48, 16)}, "repeat_span_bytes"),
    ({"repeat_content": "noise"}, "repeat_content"),
])
def test_impossible_plans_name_their_option(corpus, tmp_path, options, option):
    data = LongRangeData(root=str(corpus), seq_len=SEQ_LEN, cache_dir=str(tmp_path), **options)
    with pytest.raises(CorpusError) as error:
        data.check_files()
    assert error.value.option == option
