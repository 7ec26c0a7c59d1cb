"""``flexmoba context-eval``: its windows are the models' own losses, its differences are paired by document,
its intervals are Student's t, a killed run resumes to the same numbers, and the passkey sits where it says."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from flexmoba.checkpoint import load_model  # noqa: E402
from lit.cli import import_hf  # noqa: E402
from lit.experiments import context_eval  # noqa: E402
from lit.training.errors import UsageError  # noqa: E402
from lit.training.tokenizer import train_byte_level_bpe  # noqa: E402

from tiny_llama import VOCAB, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ_LEN, WINDOW, TRAILING = 128, 32, 16
ARMS = ["full", "moba:16:2", "moba:16:2:1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("context_eval")
    checkpoint = import_hf.main(["--source", str(save_tiny_llama(root / "hf")), "--out", str(root / "imported")])
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(f"w{(i * 13 + j * j) % VOCAB}" for j in range(300)))
    return {"root": root, "checkpoint": checkpoint, "corpus": corpus}


def job_args(setup, out: Path) -> list[str]:
    return ["--ckpt", str(setup["checkpoint"]), "--out", str(out), "--arms", json.dumps(ARMS),
            "--seq_len", str(SEQ_LEN), "--documents", "3", "--window", str(WINDOW), "--trailing", str(TRAILING),
            "--root", str(setup["corpus"]), "--patterns", '["*.txt"]', "--test_fraction", "0.5",
            "--retrieval_lengths", "[64, 128]", "--retrieval_depths", "[0.2, 0.8]", "--retrieval_trials", "2"]


@pytest.fixture(scope="module")
def finished(setup) -> Path:
    out = setup["root"] / "run"
    context_eval.main(job_args(setup, out))
    return out


def own_losses(setup, arm: str, document: str) -> torch.Tensor:
    """The document's next-token losses, computed here from the checkpoint and the tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(setup["root"] / "imported" / "tokenizer.json"))
    ids = tokenizer.encode((setup["corpus"] / document).read_text()).ids[: SEQ_LEN + 1]
    model = load_model(setup["checkpoint"], **context_eval.Arm.parse(arm).overrides())
    tokens = torch.tensor(ids)[None]
    with torch.no_grad():
        return F.cross_entropy(model(tokens[:, :-1])[0], tokens[0, 1:], reduction="none")


def test_windows_and_differences_are_the_models_own_losses(setup, finished):
    summary = json.loads((finished / "results.json").read_text())
    documents = summary["documents"]
    assert len(documents) == 3
    losses = {arm: [own_losses(setup, arm, d) for d in documents] for arm in ARMS}
    for arm in ARMS:
        for i in range(SEQ_LEN // WINDOW):
            per_document = [float(x[i * WINDOW:(i + 1) * WINDOW].mean()) for x in losses[arm]]
            assert summary["arms"][arm]["windows"][i]["mean"] == pytest.approx(statistics.mean(per_document), abs=1e-5)
        trailing = [float(x[-TRAILING:].mean()) for x in losses[arm]]
        assert summary["arms"][arm]["trailing"]["mean"] == pytest.approx(statistics.mean(trailing), abs=1e-5)
        pairs = zip(losses[arm], losses["full"], strict=True)
        paired = [float(x[-TRAILING:].mean() - f[-TRAILING:].mean()) for x, f in pairs]
        assert summary["arms"][arm]["trailing_minus_full"]["mean"] == pytest.approx(statistics.mean(paired), abs=1e-5)
    # MoBA at 16/2 over 128 tokens is sparse: its late windows are not full attention's
    assert summary["arms"]["moba:16:2"]["windows_minus_full"][-1]["mean"] != pytest.approx(0.0, abs=1e-6)
    assert summary["arms"]["moba:16:2"]["windows_minus_full"][0]["mean"] == pytest.approx(0.0, abs=1e-5)


def test_the_report_and_figures_come_from_the_records(finished):
    records = context_eval.read_records(finished / "records.jsonl")
    assert len([r for r in records if r["kind"] == "position"]) == 3 * len(ARMS)
    assert len([r for r in records if r["kind"] == "retrieval"]) == 2 * 2 * 2 * len(ARMS)
    summary = json.loads((finished / "results.json").read_text())
    cells = summary["arms"]["full"]["retrieval"]
    assert [(c["length"], c["depth"], c["trials"]) for c in cells] == [(64, 0.2, 2), (64, 0.8, 2), (128, 0.2, 2),
                                                                       (128, 0.8, 2)]
    text = (finished / "results.md").read_text()
    assert "3 held-out documents" in text and "MoBA 16/2, last 1 layers full" in text
    assert (finished / "windows.png").stat().st_size > 0 and (finished / "retrieval.png").stat().st_size > 0


def test_a_killed_run_resumes_to_the_same_numbers(setup, finished, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    lines = (finished / "records.jsonl").read_text().splitlines()
    (out / "job.json").write_text((finished / "job.json").read_text())
    (out / "records.jsonl").write_text("\n".join(lines[:7]) + "\n" + lines[7][:25])  # killed mid-write
    context_eval.main(job_args(setup, out))
    assert json.loads((out / "results.json").read_text()) == json.loads((finished / "results.json").read_text())


def test_another_jobs_records_are_refused(setup, finished):
    with pytest.raises(UsageError, match="holds the records of another context-eval"):
        context_eval.main([*job_args(setup, finished), "--documents", "2"])



@pytest.mark.parametrize("text", ["moba", "moba:16", "moba:a:2", "sparse:16:2", "moba:16:2:1:0"])
def test_an_arm_that_is_not_one_is_refused_by_name(text):
    with pytest.raises(UsageError, match="--arms"):
        context_eval.Arm.parse(text)


def test_the_passkey_sits_at_its_depth_in_a_prompt_of_its_length():
    tokenizer = train_byte_level_bpe([context_eval.FILLER * 20, context_eval.NEEDLE.format(key=12345)], 400)
    for length, depth in ((256, 0.0), (256, 0.5), (512, 0.9)):
        prompt, answer = context_eval.passkey_prompt(tokenizer, length, depth, 48213)
        assert len(prompt) + len(answer) == length
        assert tokenizer.decode(answer).strip() == "48213"
        needle = tokenizer.encode(context_eval.NEEDLE.format(key=48213)).ids
        starts = [i for i in range(len(prompt)) if prompt[i:i + len(needle)] == needle]
        room = length - len(needle) - len(tokenizer.encode(context_eval.QUESTION).ids) - len(answer)
        assert starts == [int(depth * room)]


def test_one_arm_alone_reports_its_windows_without_differences(setup, finished, tmp_path):
    args = job_args(setup, tmp_path / "alone")
    args[args.index("--arms") + 1] = '["moba:16:2"]'
    summary = context_eval.main([*args, "--retrieval_lengths", "[]"])
    entry = summary["arms"]["moba:16:2"]
    assert "windows_minus_full" not in entry
    assert entry["windows"] == json.loads((finished / "results.json").read_text())["arms"]["moba:16:2"]["windows"]


@pytest.mark.parametrize("device, problem", [("gpu9", "is not a device"), ("cuda", "no CUDA device")])
def test_a_device_it_cannot_use_is_refused_by_name(setup, tmp_path, device, problem):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(UsageError, match=f"--device: .*{problem}"):
        context_eval.main([*job_args(setup, tmp_path / "out"), "--device", device])


def test_an_arm_the_model_cannot_run_is_refused_before_anything_is_written(setup, tmp_path):
    args = job_args(setup, tmp_path / "refused")
    args[args.index("--arms") + 1] = '["full", "moba:16:2:3"]'  # the tiny Llama has 2 layers
    with pytest.raises(UsageError, match="--arms: moba:16:2:3 makes the last 3 layers full, the checkpoint's model "
                                         "has 2 layers"):
        context_eval.main(args)
    assert not (tmp_path / "refused").exists()


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both_sizes(setup, tmp_path):
    from tiny_llama import word_tokenizer

    word_tokenizer(VOCAB - 20).save(str(tmp_path / "other.json"))
    with pytest.raises(UsageError, match=f"--tokenizer: .*other.json holds {VOCAB - 20} tokens, the checkpoint's "
                                         f"model {VOCAB} \\(its vocab_size\\)"):
        context_eval.main([*job_args(setup, tmp_path / "refused"), "--tokenizer", str(tmp_path / "other.json")])
    assert not (tmp_path / "refused").exists()


def test_a_split_with_too_few_documents_is_refused_before_anything_is_written(setup, tmp_path):
    args = job_args(setup, tmp_path / "refused")
    args[args.index("--documents") + 1] = "50"  # the corpus's test half holds about 12
    with pytest.raises(UsageError, match="--documents: the test split of .* fewer than 50"):
        context_eval.main(args)
    assert not (tmp_path / "refused").exists()  # so the same folder takes the corrected job


def test_an_arm_that_cannot_be_sparse_is_named_in_a_note_and_in_the_report(setup, tmp_path, capsys):
    args = job_args(setup, tmp_path / "dense")
    args[args.index("--arms") + 1] = '["full", "moba:64:2", "moba:16:2"]'  # 64 x 2 covers all 128 positions
    context_eval.main([*args, "--retrieval_lengths", "[]"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == ["flexmoba: note: moba:64:2: MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every "
                     "earlier key (equals full attention); lower chunk_size or top_k to make it sparse"]
    report = (tmp_path / "dense" / "results.md").read_text()
    assert "Note: moba:64:2: MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every earlier key" in report
    assert "moba:16:2:" not in report


def test_the_default_patterns_are_the_data_modules():
    from lit.training.data import DEFAULT_PATTERNS

    assert context_eval.ContextEvalJob(ckpt="a", out="b").patterns == list(DEFAULT_PATTERNS)


def test_scored_windows_are_the_same_numbers_with_logits_only_where_scored(setup, finished, tmp_path, monkeypatch):
    rows = []
    real = context_eval.token_losses

    def counting(model, ids, positions=None):
        handle = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
        try:
            return real(model, ids, positions)
        finally:
            handle.remove()

    monkeypatch.setattr(context_eval, "token_losses", counting)
    args = job_args(setup, tmp_path / "scored")
    summary = context_eval.main([*args, "--scored_windows", "[3, 0]", "--retrieval_lengths", "[]"])
    everything = json.loads((finished / "results.json").read_text())
    assert summary["scored"] == [0, 3] and everything["scored"] == [0, 1, 2, 3]
    for arm in ARMS:
        ours, all_windows = summary["arms"][arm], everything["arms"][arm]
        assert ours["windows"] == [all_windows["windows"][0], all_windows["windows"][3]]
        assert ours["trailing"] == all_windows["trailing"]
    # windows 0 and 3 of 32 positions (the trailing 16 inside window 3): 64 rows of logits per document and arm
    assert rows == [2 * WINDOW] * (3 * len(ARMS))
    assert "| 0–32 | 96–128 | trailing |" in (tmp_path / "scored" / "results.md").read_text()


@pytest.mark.parametrize("scored", ["[]", "[4]", "[1, 1]", "[-1]"])
def test_scored_windows_that_are_not_windows_are_refused_by_name(setup, tmp_path, scored):
    with pytest.raises(UsageError, match=r"^--scored_windows: .* in \[0, 4\)"):
        context_eval.main([*job_args(setup, tmp_path / "out"), "--scored_windows", scored])
    assert not (tmp_path / "out").exists()


def test_a_passkey_computes_logits_at_the_answer_only(setup):
    model = load_model(setup["checkpoint"])
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    prompt, answer = list(range(1, 40)), [5, 6, 7]
    answered, loss = context_eval.answers(model, prompt, answer)
    tokens = torch.tensor(prompt + answer)[None]
    with torch.no_grad():
        logits = model(tokens[:, :-1])[0, len(prompt) - 1:]
    assert rows == [len(answer), len(prompt) + len(answer) - 1]  # ours, then the whole forward here
    assert loss == pytest.approx(float(F.cross_entropy(logits, torch.tensor(answer))), abs=1e-6)
    assert answered == bool((logits.argmax(-1) == torch.tensor(answer)).all())
