"""A flexmoba checkpoint's GPT as an lm-evaluation-harness model, under one attention arm.

    from lit.experiments.lm_eval_model import FlexmobaLM  # registers the model name "flexmoba"
    lm = FlexmobaLM("runs/pretrained/smollm2/model.ckpt", arm="moba:512:3:10")
    lm_eval.simple_evaluate(model=lm, tasks=["niah_single_1"], metadata={"tokenizer": ..., "max_seq_lengths": [4096]})

The model is :func:`flexmoba.checkpoint.load_model` of the checkpoint with the arm's overrides
(:meth:`lit.experiments.context_eval.Arm.overrides`: ``full``, ``moba:CHUNK:TOPK``, ``moba:CHUNK:TOPK:N``
with the last N layers full), the text goes through the checkpoint's own tokenizer (or the ``tokenizer``
folder given), and ``generate_until`` decodes greedily with the GPT's KV caches
(:meth:`flexmoba.model.GPT.generate_steps`; MoBA decode under a MoBA arm, full attention for the new tokens
with ``dense_decode``). As lm-eval's Hugging Face model does, a context longer than ``max_length`` minus the
tokens to generate loses its first tokens, a generation stops at the end-of-text token or at a stop string
and is cut before it. One sequence at a time: the GPT takes no padding mask, so ``batch_size`` is ignored.

Only ``generate_until`` tasks run (RULER's are); the log-likelihood requests raise ``NotImplementedError``.
This module imports lm-eval: ``pip install 'flexmoba[eval]'``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from flexmoba.checkpoint import checkpoint_tokenizer, load_model, read_checkpoint
from lit.experiments.context_eval import Arm

# The names pretrained tokenizers give their end-of-text token, the likeliest first.
END_OF_TEXT = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
DEFAULT_MAX_GEN_TOKS = 256  # as lm-eval's Hugging Face model, for a task that does not say


def end_of_text_token(tokenizer) -> str | None:
    """The end-of-text token of a ``tokenizers.Tokenizer`` (the first of :data:`END_OF_TEXT` it holds as a
    special token), or None. A flexmoba checkpoint carries the tokenizer's JSON only, which does not say."""
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    return next((name for name in END_OF_TEXT if name in special), None)


def hf_tokenizer(tokenizer_json: str, eos_token: str | None = "auto"):
    """``transformers``' fast tokenizer over a ``tokenizers`` JSON; ``eos_token`` ``"auto"``:
    :func:`end_of_text_token`, None: none."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = end_of_text_token(tokenizer) if eos_token == "auto" else eos_token
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


@register_model("flexmoba")
class FlexmobaLM(LM):
    """lm-eval's model for a flexmoba checkpoint under one arm (see the module's doc).

    Args:
        pretrained: a flexmoba checkpoint (path, or the dict :func:`flexmoba.checkpoint.read_checkpoint` read).
        arm: ``full``, ``moba:CHUNK:TOPK`` or ``moba:CHUNK:TOPK:N`` (the last N layers full).
        tokenizer: a transformers tokenizer folder (default: the checkpoint's tokenizer).
        device: where the model runs.
        dense_decode: generated tokens attend with full attention (MoBA prefill only; the paper's protocol).
        max_length: the longest context plus generation (default: the model's ``max_seq_len``).
    """

    def __init__(self, pretrained: str | Path | dict, arm: str = "full", tokenizer: str | None = None,
                 device: str | None = "cpu", dense_decode: bool = False, max_length: int | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None):
        super().__init__()
        checkpoint = pretrained if isinstance(pretrained, dict) else read_checkpoint(pretrained)
        self.arm = Arm.parse(arm)
        self._device = torch.device(device or "cpu")
        self.model = load_model(checkpoint, self._device, **self.arm.overrides())
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        else:
            tokenizer_json = checkpoint_tokenizer(checkpoint)
            if tokenizer_json is None:
                raise ValueError("the checkpoint carries no tokenizer; give FlexmobaLM a tokenizer folder")
            self.tokenizer = hf_tokenizer(tokenizer_json)
        self.dense_decode = dense_decode in (True, "True", "true", "1")
        self.max_length = int(max_length or self.model.config.max_seq_len or 2**31)

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def tok_encode(self, text: str) -> list[int]:
        """The ids of ``text``: the tokenizer's call as RULER makes it when it sizes a prompt."""
        return self.tokenizer(text).input_ids

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        """Up to ``max_new`` greedy tokens after ``ids``; stops before the end-of-text token and once the
        text holds a stop string (the caller cuts it)."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self._device)
        stops = [s for s in until if s]
        new: list[int] = []
        for token in self.model.generate_steps(tokens, max_new, temperature=0.0, dense_decode=self.dense_decode):
            token = int(token[0, 0])
            if token == self.eot_token_id:
                break
            new.append(token)
            if stops and any(s in self.tokenizer.decode(new) for s in stops):
                break
        return new

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests"):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ValueError(f"FlexmobaLM decodes greedily; the task asks to sample ({gen_kwargs})")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.eos_token)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise ValueError(f"{max_new} tokens to generate leave no context within max_length {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            text = postprocess_generated_text(self.tokenizer.decode(self.greedy(ids, max_new, until)), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("FlexmobaLM runs generate_until tasks (RULER's); this task asks for log-likelihoods")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("FlexmobaLM runs generate_until tasks (RULER's); this task asks for log-likelihoods")

    def get_model_info(self) -> dict:
        """What lm-eval writes into its results' ``config``: the arm and how each layer attends."""
        return {"flexmoba_arm": self.arm.name, "layer_attention": self.model.layer_attention(),
                "dense_decode": self.dense_decode, "max_length": self.max_length,
                "model_num_parameters": self.model.num_parameters(non_embedding=False)}
