"""A tiny character-level language model that streams its tokens, written to Triton's Python-backend API.

Its weights are a table of next-character log-probabilities for every pair of previous
characters, made at ``initialize`` from ``corpus.txt`` beside this file: trigram counts mixed
with bigram and unigram ones, so every character keeps some probability. The vocabulary is
printable ASCII, newline and an end-of-text token (the end of each paragraph of the corpus):
every token is one byte, so the model counts the prompt's UTF-8 bytes as its input tokens.

Decoupled: ``execute`` is a coroutine (executes of several requests overlap on the instance's
event loop) that sends one response per token and ends with the final flag when it samples the
end-of-text token, reaches ``max_tokens`` (default 64) or the context length, or sees that the
request was cancelled (the client went away, or the server found a stop sequence).

Inputs: ``text_input`` (the prompt), optional ``max_tokens`` (INT32), ``temperature`` (FP32,
default 0.8; 0 = always the likeliest token), ``top_p`` (FP32, default 1), ``seed`` (UINT64;
without it every request samples differently). Outputs: ``text_output`` (the token),
``num_input_tokens`` and ``num_output_tokens`` (UINT32). A prompt as long as the context
(config parameter ``pyserve_openai_context_length``, default 256) is refused as INVALID_ARG.
"""

import asyncio
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
END = len(VOCAB)
"""The end-of-text token (also the context before the first character)."""
SIZE = END + 1
_INDEX = np.full(256, VOCAB.index(" "), dtype=np.int64)  # bytes outside the vocabulary read as a space
for _i, _c in enumerate(VOCAB):
    _INDEX[ord(_c)] = _i
_BYTES = [c.encode("ascii") for c in VOCAB]


def build_weights(text):
    """Log-probabilities ``[previous-but-one, previous, next]`` (float32) learnt from ``text``."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    ids = []
    for paragraph in paragraphs:
        ids += [END, END] + [int(_INDEX[b]) for b in paragraph.encode("utf-8")] + [END]
    ids = np.array(ids, dtype=np.int64)
    tri = np.zeros((SIZE, SIZE, SIZE), dtype=np.float64)
    np.add.at(tri, (ids[:-2], ids[1:-1], ids[2:]), 1.0)
    bi = tri.sum(axis=0)
    uni = bi.sum(axis=0) + 1.0  # every token seen at least once
    uni /= uni.sum()
    bi_rows = bi.sum(axis=1, keepdims=True)
    bi = np.where(bi_rows > 0, bi / np.maximum(bi_rows, 1.0), uni)
    tri_rows = tri.sum(axis=2, keepdims=True)
    tri = np.where(tri_rows > 0, tri / np.maximum(tri_rows, 1.0), bi[None, :, :])
    mixed = 0.75 * tri + 0.2 * bi[None, :, :] + 0.05 * uni
    return np.log(mixed).astype(np.float32)


def sample(logits, temperature, top_p, rng):
    """One token id from ``logits`` with ``temperature`` (0: the likeliest) and nucleus ``top_p``."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return int(rng.choice(SIZE, p=probs))


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        self.context = int(parameters.get("pyserve_openai_context_length", {}).get("string_value", "256"))
        corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
        with open(corpus, encoding="utf-8") as f:
            self.weights = build_weights(f.read())

    async def execute(self, requests):
        for request in requests:
            await self.generate(request)
        return None

    async def generate(self, request):
        sender = request.get_response_sender()
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
        prompt = prompt if isinstance(prompt, bytes) else str(prompt).encode("utf-8")
        if len(prompt) >= self.context:
            error = pb_utils.TritonError(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.context} tokens",
                pb_utils.TritonError.INVALID_ARG,
            )
            sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        limit = min(int(_scalar(request, "max_tokens", 64)), self.context - len(prompt))
        temperature = float(_scalar(request, "temperature", 0.8))
        top_p = float(_scalar(request, "top_p", 1.0))
        seed = _scalar(request, "seed", None)
        rng = np.random.default_rng(seed)
        context = [END, END] + [int(_INDEX[b]) for b in prompt]
        a, b = context[-2], context[-1]
        prompt_tokens = np.array([len(prompt)], dtype=np.uint32)
        one = np.array([1], dtype=np.uint32)
        for _ in range(limit):
            if sender.is_cancelled():
                break
            token = sample(self.weights[a, b], temperature, top_p, rng)
            if token == END:
                break
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([_BYTES[token]], dtype=np.object_)),
                pb_utils.Tensor("num_input_tokens", prompt_tokens),
                pb_utils.Tensor("num_output_tokens", one),
            ]))
            a, b = b, token
            await asyncio.sleep(0)  # the other requests' tokens go out between this one's
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
