"""Token-level corpus: the files of :class:`ByteFilesData` as token ids of a Hugging Face ``tokenizers`` tokenizer.

- The tokenizer is a byte-level BPE trained on the train split's documents (``vocab_size``
  tokens at most, no special tokens), or a ``tokenizer.json`` from disk (``tokenizer``).
- The corpus is tokenized once into the memory-mapped cache: ``<stem>.bin`` holds every
  document's token ids back to back, ``uint16`` when the vocabulary has at most 65,536 tokens,
  else ``uint32`` (nanoGPT's flat layout; ``np.memmap(path, dtype)`` reads it), beside the
  document offsets (``.npy``, in tokens), the tokenizer (``.tokenizer.json``) and the manifest,
  which counts each split's tokens and bytes. Sequences, windows and positions are in tokens.
- Bits per byte: nats per token over ``ln 2`` and the split's bytes per token (its documents'
  bytes over their tokens), :meth:`TokenFilesData.bytes_per_token`.
- The model's ``vocab_size`` follows the data (:meth:`TokenFilesData.vocabulary_of`, read when a
  command line is parsed); checkpoints carry the tokenizer, and ``flexmoba export-hf`` writes it
  beside the weights.
- Files are read as UTF-8 (an invalid byte becomes U+FFFD; bytes are counted as on disk).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lit.training.data import SPLITS, ByteFilesData, CorpusError, TokenCache, member_files, read_member

TOKENIZER_SUFFIX = ".tokenizer.json"
DEFAULT_VOCAB_SIZE = 4096
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte
UINT16_VOCAB = 2**16
ENCODE_BATCH = 64  # documents per encode_batch call


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type of the token file: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) of at most ``vocab_size`` tokens trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str, option: str = "tokenizer"):
    """The tokenizer saved at ``path`` (a ``tokenizer.json``); CorpusError naming ``option`` if there is none."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        what = "is a directory, not a tokenizer.json" if os.path.isdir(path) else "does not exist"
        raise CorpusError(option, f"{option}={path!r} {what}")
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CorpusError(option, f"{option}={path!r} is not a Hugging Face tokenizers file: "
                                  f"{' '.join(str(error).split())}") from None


def document_text(root: str, document: str, members: dict[str, list[str]] | None,
                  not_text: list[str] | None = None) -> tuple[str, int]:
    """A document's text (its files concatenated; bytes that are not UTF-8 read as U+FFFD, the files
    holding them named in ``not_text``) and its size in bytes."""
    data = b"".join(read_member(root, rel, not_text) for rel in member_files(document, members))
    return data.decode("utf-8", errors="replace"), len(data)


def batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class TokenIdCache(TokenCache):
    """The corpus as token ids, with its tokenizer: trained on the first ``n_train`` documents
    (the train split) when ``tokenizer`` is None, else the given one."""

    extra_suffixes = (TOKENIZER_SUFFIX,)

    def __init__(self, cache_dir: str, stem: str, vocab_size: int, tokenizer=None, n_train: int = 0):
        super().__init__(cache_dir, stem)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size, self.tokenizer, self.n_train = vocab_size, tokenizer, n_train
        self.document_bytes: list[int] = []

    def write_tokens(self, root: str, documents: list[tuple[str, int]], tmp: dict[str, Path],
                     members: dict[str, list[str]] | None) -> np.ndarray:
        tokenizer = self.tokenizer or train_byte_level_bpe(
            (document_text(root, name, members)[0] for name, _ in documents[: self.n_train]), self.vocab_size)
        tokenizer.save(str(tmp[TOKENIZER_SUFFIX]))
        offsets, self.document_bytes = [0], []
        with open(tmp[".bin"], "wb") as out:
            for batch in batches(documents, ENCODE_BATCH):
                texts, sizes = zip(*(document_text(root, name, members, self.not_text) for name, _ in batch),
                                   strict=True)
                for encoding in tokenizer.encode_batch(list(texts)):
                    np.asarray(encoding.ids, dtype=self.dtype).tofile(out)
                    offsets.append(offsets[-1] + len(encoding.ids))
                self.document_bytes += sizes
        return np.asarray(offsets, dtype=np.int64)

    def write_extras(self, tmp: dict[str, Path], manifest: dict) -> dict:
        starts = np.cumsum([0, *self.document_bytes])
        documents = manifest["documents"]
        split_bytes = {split: int(starts[last] - starts[first]) for split, (first, last) in documents.items()}
        return {**manifest, "bytes": split_bytes, "vocab_size": self.vocab_size, "dtype": self.dtype.name}

    def read_tokenizer_json(self) -> str:
        return self.path(TOKENIZER_SUFFIX).read_text()


class TokenFilesData(ByteFilesData):
    """:class:`ByteFilesData` as tokens: a byte-level BPE trained on the train split, or a ``tokenizer.json``.

    Args:
        tokenizer: a ``tokenizer.json`` (Hugging Face ``tokenizers``) to load; default: train a
            byte-level BPE of ``vocab_size`` tokens on the train split's documents.
        vocab_size: the vocabulary (and the model's ``vocab_size``): the trained BPE's size (at most;
            default 4096), or, with ``tokenizer``, left out or equal to that tokenizer's.
        **kwargs: the arguments of :class:`ByteFilesData`; ``seq_len`` counts tokens.
    """

    def __init__(self, tokenizer: str | None = None, vocab_size: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.tokenizer_path = tokenizer
        self.requested_vocab_size = vocab_size
        self.tokenizer_json: str | None = None
        self._vocab_size: int | None = None
        self._manifest: dict | None = None

    @staticmethod
    def vocabulary_of(init_args: dict) -> int:
        """The vocabulary of a ``TokenFilesData`` with these arguments, without reading the corpus;
        CorpusError naming the option when the tokenizer is missing or does not match ``vocab_size``."""
        path, requested = init_args.get("tokenizer"), init_args.get("vocab_size")
        if path is None:
            vocab = DEFAULT_VOCAB_SIZE if requested is None else requested
            if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= BYTE_ALPHABET:
                raise CorpusError("vocab_size", f"vocab_size of a trained byte-level BPE must be an int above "
                                                f"{BYTE_ALPHABET} (its byte alphabet), got {vocab!r}")
            return vocab
        actual = load_tokenizer(path).get_vocab_size()
        if requested is not None and requested != actual:
            raise CorpusError("vocab_size", f"vocab_size={requested} does not match the {actual} tokens of "
                                            f"tokenizer={path!r}; leave vocab_size out to use the tokenizer's")
        return actual

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self.vocabulary_of({"tokenizer": self.tokenizer_path,
                                                   "vocab_size": self.requested_vocab_size})
        return self._vocab_size

    def check_files(self) -> None:
        """Also the tokenizer: CorpusError naming ``tokenizer`` or ``vocab_size``."""
        _ = self.vocab_size
        super().check_files()

    def _tokenizer_key(self) -> dict:
        if self.tokenizer_path is None:
            return {"bpe": "byte-level", "vocab_size": self.vocab_size}
        return {"tokenizer": hashlib.sha256(Path(self.tokenizer_path).read_bytes()).hexdigest()[:16]}

    def _fingerprint(self, selected: dict[str, list[tuple[str, int]]]) -> str:
        options = {"corpus": super()._fingerprint(selected), **self._tokenizer_key()}
        return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]

    def _token_cache(self, key: str) -> TokenIdCache:
        given = None if self.tokenizer_path is None else load_tokenizer(self.tokenizer_path)
        n_train = len(self._selected_files()["train"])
        return TokenIdCache(self.cache_dir, f"tokens-{key}", self.vocab_size, given, n_train)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self._manifest is None:
            cache, _ = self._cache()
            self._manifest = cache.manifest()
            self.tokenizer_json = cache.read_tokenizer_json()

    def split_tokens(self, split: str) -> int:
        """Tokens in ``split``, as the tokenizer cut it (once set up)."""
        return int(self._manifest["tokens"][split])

    def bytes_per_token(self, stage: str) -> float:
        """Bytes per token of the split ``stage`` evaluates (test falls back to val, as its loader does)."""
        split = stage if stage in SPLITS and self._manifest["tokens"].get(stage) else "val"
        return self._manifest["bytes"][split] / self._manifest["tokens"][split]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "tokenizer_json": self.tokenizer_json}
