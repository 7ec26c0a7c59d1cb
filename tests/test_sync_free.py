"""The GPU training path reads nothing back to the host.

On the meta device a tensor has a shape and no data: ``.item()``, ``bool(tensor)``,
``.tolist()`` and data-dependent shapes (``nonzero``, ``bincount``) raise. A GPT forward and
backward with ``backend="flex"`` (the gate, the layout, the regrouped plan's tables, flex
through the stand-in, the log-sum-exp merge) running there is therefore free of device
syncs. With documents the layout reads the number of chunks once (documented in
:func:`flexmoba.layout.chunk_layout`); everything after the layout runs on meta too.
"""

import dataclasses

import pytest
import torch
from flex_standin import flex_standin
from torch.utils._python_dispatch import TorchDispatchMode

from flexmoba import MobaSpec, moba_attention, use_flex_attention
from flexmoba.layout import chunk_layout
from flexmoba.model import GPT, ModelConfig
from flexmoba.tuning import use_tuning

META = torch.device("meta")


def meta_gpt(spec: MobaSpec) -> GPT:
    with META:
        return GPT(ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, moba=spec))


@pytest.mark.parametrize("spec", [MobaSpec(8, 2, backend="flex"), MobaSpec(8, 3, granularity=4, backend="flex"),
                                  MobaSpec(8, 2, backend="flex_union")], ids=["plan", "tiles", "union"])
def test_gpt_forward_and_backward_run_on_the_meta_device(spec):
    model = meta_gpt(spec)
    tokens = torch.zeros(2, 44, dtype=torch.long, device=META)  # 44: ragged against chunks and blocks
    with use_flex_attention(flex_standin):
        model(tokens).float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_a_host_read_fails_on_meta():
    """The premise: each kind of host read this file guards against raises on meta."""
    x = torch.ones(3, device=META)
    for read in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.tolist(), lambda: x.nonzero(),
                 lambda: torch.bincount(x.long())):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


def documents_problem(device):
    ids = torch.tensor([[0] * 13 + [1] * 20 + [2] * 11, [5] * 44], device=device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 44, 8, generator=gen).to(device) for h in (4, 2, 2))
    return q, k, v, ids


def on_meta(layout):
    return dataclasses.replace(layout, **{f.name: getattr(layout, f.name).to(META)
                                          for f in dataclasses.fields(layout)
                                          if isinstance(getattr(layout, f.name), torch.Tensor)})


@pytest.mark.parametrize("backend", ["flex", "flex_union"])
def test_with_documents_only_the_layout_reads_the_host(backend):
    """The layout built once (on CPU, as a model would before its layers) and moved to meta:
    gate, plan, flex and merge with documents, forward and backward, run on meta."""
    q, k, v, ids = documents_problem("cpu")
    layout = on_meta(chunk_layout(2, 44, 8, torch.device("cpu"), ids))
    q, k, v = (t.to(META).requires_grad_() for t in (q, k, v))
    with use_flex_attention(flex_standin):
        out = moba_attention(q, k, v, chunk_size=8, top_k=2, backend=backend, document_ids=ids.to(META),
                             layout=layout)
        out.sum().backward()
    assert q.grad.shape == q.shape


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's data back to the host or size a result by it."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.reads_host(func, args):
            self.reads.append(func.name())
        return func(*args, **(kwargs or {}))

    @staticmethod
    def reads_host(func, args) -> bool:
        if func is torch.ops.aten.index.Tensor:  # tagged dynamic for boolean indices only
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        return torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags


def test_the_whole_documents_path_reads_the_chunk_count_once():
    """Off CPU the gate scores every chunk in one span; on CPU it reads its spans' bounds (tighter
    spans, a read the CPU does not pay a sync for), so the spans other devices take are forced here."""
    q, k, v, ids = documents_problem("cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with use_tuning("cpu", spans_read_host=False), use_flex_attention(flex_standin), HostReads() as counter:
        moba_attention(q, k, v, chunk_size=8, top_k=2, backend="flex", document_ids=ids).sum().backward()
    assert counter.reads == ["aten::_local_scalar_dense"], counter.reads


def test_the_counter_sees_a_nonzero_and_an_item():
    with HostReads() as counter:
        x = torch.tensor([0.0, 1.0])
        x.nonzero()
        x.sum().item()
        x[x > 0]
        x[torch.tensor([1])]  # an integer index is no read
    assert counter.reads == ["aten::nonzero", "aten::_local_scalar_dense", "aten::index.Tensor"]
