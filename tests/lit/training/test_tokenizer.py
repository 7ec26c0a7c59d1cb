"""Token-level data: a BPE trained on the files or a tokenizer.json, the flat token file, the vocabulary
flowing into the model, bits per byte, and a 5-step run validated, exported and loaded in transformers."""

import math
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from lit.cli import lightning_cli  # noqa: E402
from lit.training.data import CorpusError, default_root, list_files  # noqa: E402
from lit.training.launch import read_config, run_cli  # noqa: E402
from lit.training.tokenizer import TokenFilesData, token_dtype  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
VOCAB = 300
SEQ_LEN = 64


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    """Twelve real stdlib modules of 3-12 KB."""
    root = tmp_path_factory.mktemp("code")
    stdlib = default_root()
    chosen = [rel for rel, size in list_files(stdlib) if 3_000 <= size <= 12_000 and "/" not in rel][:12]
    for rel in chosen:
        shutil.copy(Path(stdlib) / rel, root / rel)
    return root


def make(root, cache, **kwargs):
    data = TokenFilesData(root=str(root), seq_len=SEQ_LEN, batch_size=2, val_fraction=0.25, test_fraction=0.0,
                          cache_dir=str(cache), **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def documents(data, split):
    return [Path(data.root, name).read_text() for name, _ in data._selected_files()[split]]


def test_the_token_file_is_each_documents_ids_back_to_back(code, tmp_path):
    data = make(code, tmp_path, vocab_size=VOCAB)
    (tokenizer_file,) = tmp_path.glob("tokens-*.tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    assert tokenizer.get_vocab_size() == VOCAB
    (bin_file,) = tmp_path.glob("tokens-*.bin")
    flat = np.fromfile(bin_file, dtype=np.uint16)  # nanoGPT's layout: ids back to back, no header
    texts = documents(data, "train") + documents(data, "val")
    ids = [tokenizer.encode(text).ids for text in texts]
    assert flat.tolist() == [i for doc in ids for i in doc]
    assert [tokenizer.decode(doc) for doc in ids] == texts  # byte-level: nothing lost
    assert data.datasets["train"].tokens.dtype == np.uint16 and max(flat) < VOCAB
    inputs, targets = data.datasets["train"][0]
    assert inputs.tolist() == ids[0][:SEQ_LEN] and targets.tolist() == ids[0][1 : SEQ_LEN + 1]


def test_a_file_that_is_not_text_is_named_when_tokenized(code, tmp_path):
    root = tmp_path / "code"
    shutil.copytree(code, root)
    victim = sorted(root.iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:2000] + bytes([0xFF, 0xFE, 0x80]) * 100)
    line = make(root, tmp_path / "cache", vocab_size=VOCAB).summary()[-1]
    assert line == (f"data: 1 file is not UTF-8 text ({victim.name}), its invalid bytes read as U+FFFD; leave it "
                    "out with --data.patterns or by moving it away")


def test_token_datasets_pickle_by_file_name_with_their_dtype(code, tmp_path):
    dataset = make(code, tmp_path, vocab_size=VOCAB).datasets["train"]
    copy = pickle.loads(pickle.dumps(dataset))  # what a spawned DataLoader worker gets
    assert isinstance(copy.tokens, np.memmap) and copy.tokens.dtype == np.uint16
    assert torch.equal(copy[0][0], dataset[0][0])


def test_bytes_per_token_counts_the_split(code, tmp_path):
    data = make(code, tmp_path, vocab_size=VOCAB)
    tokenizer = Tokenizer.from_str(data.tokenizer_json)
    texts = documents(data, "val")
    n_bytes = sum(len(text.encode()) for text in texts)
    n_tokens = sum(len(tokenizer.encode(text).ids) for text in texts)
    assert data.bytes_per_token("val") == pytest.approx(n_bytes / n_tokens)
    assert data.bytes_per_token("test") == data.bytes_per_token("val")  # no test split: val stands in
    assert n_bytes / n_tokens > 1.2  # 44 merges already pay


def word_level_tokenizer(path: Path, size: int) -> Path:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_json_from_disk_and_ids_past_uint16(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    root = tmp_path / "words"
    root.mkdir()
    words = [f"w{i}" for i in (1, 65535, 65536, 69999)]
    for i in range(8):
        (root / f"doc{i}.txt").write_text(" ".join(words[(i + j) % 4] for j in range(SEQ_LEN + 10)))
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    assert TokenFilesData.vocabulary_of({"tokenizer": str(tokenizer)}) == 70_000
    data = make(root, tmp_path / "cache", patterns=["*.txt"], tokenizer=str(tokenizer))
    assert data.datasets["train"].tokens.dtype == np.uint32
    inputs, _ = data.datasets["train"][0]
    assert set(inputs.tolist()) == {1, 65535, 65536, 69999}


@pytest.mark.parametrize(("init_args", "option", "words"), [
    ({"tokenizer": "missing/tokenizer.json"}, "tokenizer", "does not exist"),
    ({"tokenizer": "."}, "tokenizer", "is a directory"),
    ({"vocab_size": 200}, "vocab_size", "above 256"),
])
def test_a_missing_tokenizer_or_impossible_vocabulary_names_its_option(init_args, option, words):
    with pytest.raises(CorpusError) as error:
        TokenFilesData.vocabulary_of(init_args)
    assert error.value.option == option and words in str(error.value)


def fit_args(code, root, cache, *extra):
    return ["--config", str(REPO / "configs" / "moba.yaml"), "--config", str(REPO / "configs" / "tiny.yaml"),
            "--data", "lit.training.tokenizer.TokenFilesData", "--data.root", str(code), "--data.cache_dir", str(cache),
            "--data.seq_len", str(SEQ_LEN), "--data.val_fraction", "0.25", "--data.test_fraction", "0",
            "--model.position_window", "16", "--model.trailing_window", "16",
            "--trainer.default_root_dir", str(root), *extra]


def one_line_error(args, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli.main(args)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.count("\n") == 1, stderr
    return stderr.rstrip("\n")


def test_tokenizer_and_vocabulary_mismatches_are_one_line_errors(code, tmp_path, capsys, monkeypatch):
    words = word_level_tokenizer(tmp_path / "words.json", 500)
    cases = {
        ("--data.tokenizer", str(tmp_path / "nope.json")): "flexmoba: error: --data.tokenizer: tokenizer=",
        ("--data.tokenizer", str(words), "--data.vocab_size", "400"):
            "flexmoba: error: --data.vocab_size: vocab_size=400 does not match the 500 tokens",
        ("--data.vocab_size", "400", "--model.config.vocab_size", "1000"):
            "flexmoba: error: --model.config.vocab_size: 1000 does not match the data's vocabulary of 400",
    }
    for extra, start in cases.items():
        run = tmp_path / "run"
        assert one_line_error(["fit", *fit_args(code, run, tmp_path / "cache", *extra)], capsys,
                              monkeypatch).startswith(start)
        assert not run.exists()  # refused before anything is built


def test_the_model_vocabulary_follows_the_data(code, tmp_path):
    words = word_level_tokenizer(tmp_path / "words.json", 500)
    trained = read_config(fit_args(code, tmp_path / "run", tmp_path / "cache", "--data.vocab_size", "400"))
    loaded = read_config(fit_args(code, tmp_path / "run", tmp_path / "cache", "--data.tokenizer", str(words)))
    assert trained["model"]["config"]["vocab_size"] == 400 and loaded["model"]["config"]["vocab_size"] == 500


@pytest.mark.slow
def test_fit_validate_export_and_load_in_transformers(code, tmp_path, capsys, monkeypatch, metrics_of):
    transformers = pytest.importorskip("transformers")
    from flexmoba.checkpoint import load_model
    from flexmoba.integrations.transformers import register
    from lit.cli import export_hf

    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    run, cache = tmp_path / "run", tmp_path / "cache"
    args = fit_args(code, run, cache, "--data.vocab_size", str(VOCAB))
    fit = run_cli(["fit", *args, "--trainer.max_steps", "5", "--trainer.val_check_interval", "5"])
    assert fit.model.config.vocab_size == VOCAB and fit.trainer.global_step == 5
    validated = run_cli(["validate", *args, "--ckpt_path", "last"]).trainer.callback_metrics
    bytes_per_token = fit.datamodule.bytes_per_token("val")
    assert float(validated["val/bpb"]) == pytest.approx(float(validated["val/loss"]) / math.log(2) / bytes_per_token)
    windows = sorted(key for key in validated if key.startswith("val/loss_pos_"))
    assert windows[-1] == f"val/loss_pos_{SEQ_LEN - 16:06d}_{SEQ_LEN:06d}"  # windows count tokens

    out = export_hf.main(["--ckpt", str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "hf")])
    register()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="flexmoba").eval()
    text = documents(fit.datamodule, "val")[0][:400]
    ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
    assert ids[0].tolist() == Tokenizer.from_str(fit.datamodule.tokenizer_json).encode(text).ids
    assert hf_tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        expected = load_model(run / "checkpoints" / "last.ckpt")(ids)
        torch.testing.assert_close(hf_model(ids).logits, expected, rtol=1e-4, atol=1e-4)
