"""Gate diagnostics against hand-computed cases."""

import torch

from flexmoba import select_chunks
from flexmoba.diagnostics import distance_histogram, gate_recall, selection_distances, selects_position


def test_gate_recall_is_one_when_top_k_covers_every_chunk():
    q, k = torch.randn(2, 4, 64, 8), torch.randn(2, 2, 64, 8)
    recall = gate_recall(q, k, chunk_size=16, top_k=4, query_block=10)
    torch.testing.assert_close(recall, torch.ones(2, 4, 64))


def test_gate_recall_hand_computed():
    # One head, 4 keys in chunks of 1, top_k = 1: each query keeps only itself.
    q = torch.zeros(1, 1, 4, 2)
    k = torch.zeros(1, 1, 4, 2)  # equal logits: full attention spreads 1/(t+1) on each key
    recall = gate_recall(q, k, chunk_size=1, top_k=1)
    torch.testing.assert_close(recall[0, 0], torch.tensor([1.0, 1 / 2, 1 / 3, 1 / 4]))
    # top_k = 2 adds the best past chunk (all tie at 0; any one of them): one more key's share.
    recall = gate_recall(q, k, chunk_size=1, top_k=2)
    torch.testing.assert_close(recall[0, 0], torch.tensor([1.0, 1.0, 2 / 3, 2 / 4]))


def test_selection_distances_and_histogram():
    torch.manual_seed(0)
    q, k = torch.rand(1, 1, 40, 4) + 0.1, 0.1 * torch.randn(1, 1, 40, 4)
    k[0, 0, 0:8] = 5.0  # positive queries score chunk 0 highest: it wins every past slot
    selection = select_chunks(q, k, chunk_size=8, top_k=2)
    distances = selection_distances(selection)
    own = torch.arange(40) // 8
    assert torch.equal(distances, own[own > 0])  # each query past chunk 0 picks chunk 0
    hist = distance_histogram(selection)
    assert hist.tolist() == [0, 8, 8, 8, 8]


def test_selects_position_marks_queries_that_picked_the_needle_chunk():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 32, 4), torch.randn(1, 1, 32, 4)
    selection = select_chunks(q, k, chunk_size=8, top_k=1)  # own chunk only
    hit = selects_position(selection, torch.tensor([10]))[0, 0]
    expected = torch.zeros(32, dtype=torch.bool)
    expected[10:16] = True  # queries in the needle's own chunk, at or after it
    assert torch.equal(hit, expected)
