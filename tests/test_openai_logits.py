"""prunus.serve.logits_processors against transformers' logits processors on the same logits (logit_bias,
repetition penalty, min_new_tokens; presence / frequency as OpenAI defines them), and the engine's per-token
log-probabilities against a teacher-forced forward pass of the same model."""

from __future__ import annotations

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, save_model
from prunus.serve import Engine
from prunus.serve.logits_processors import LogitsSettings, SeenTokens, process_row
from prunus.serve.request import StreamToken

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

VOCAB = 40


def reference(logits: torch.Tensor, s: LogitsSettings, prompt: list[int], generated: list[int], stops) -> torch.Tensor:
    """transformers' processors in generate's order, OpenAI's presence / frequency penalties between."""
    ids = torch.tensor([prompt + generated])
    out = logits[None].clone()
    if s.logit_bias:
        out = SequenceBiasLogitsProcessor({(t,): b for t, b in s.logit_bias})(ids, out)
    if s.repetition_penalty != 1.0:
        out = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, out)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel()).float()
    out = out - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
    if s.min_tokens:
        out = MinNewTokensLengthLogitsProcessor(len(prompt), s.min_tokens, list(stops))(ids, out)
    return out[0]


SETTINGS = [
    LogitsSettings(repetition_penalty=1.3),
    LogitsSettings(repetition_penalty=0.7),
    LogitsSettings(presence_penalty=0.8, frequency_penalty=-0.4),
    LogitsSettings(logit_bias=((3, 5.0), (7, -100.0), (9, 0.5))),
    LogitsSettings(min_tokens=5),
    LogitsSettings(min_tokens=2),
    LogitsSettings(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=2.0,
                   logit_bias=((1, 3.0), (2, -2.0)), min_tokens=6),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=range(len(SETTINGS)))
def test_processing_equals_transformers(settings):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=g) * 3
    prompt, generated, stops = [1, 5, 5, 9, 2], [3, 3, 7, 11], (0, 2)
    got = process_row(logits, settings, prompt, generated, stops)
    want = reference(logits, settings, prompt, generated, stops)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-5), (got - want).abs().max()
    assert settings.min_tokens <= len(generated) or torch.isinf(got[list(stops)]).all()


@pytest.mark.parametrize("settings", SETTINGS[:3] + SETTINGS[-1:], ids=range(4))
def test_running_history_equals_transformers_at_every_step(settings):
    """The history a request keeps (one token folded in per step) gives the processors' logits at each step."""
    g = torch.Generator().manual_seed(1)
    prompt, stops = [1, 5, 5, 9, 2], (0, 2)
    history, generated = SeenTokens(prompt, VOCAB, "cpu"), []
    for token in [3, 3, 7, 11, 1, 3]:
        logits = torch.randn(VOCAB, generator=g) * 3
        got = process_row(logits, settings, prompt, generated, stops, history)
        want = reference(logits, settings, prompt, generated, stops)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[finite], want[finite], atol=1e-5), (got - want).abs().max()
        generated.append(token)
    assert history.folded == len(generated) - 1


def test_settings_out_of_range_are_one_line():
    for settings, words in ((LogitsSettings(presence_penalty=3.0), "presence_penalty"),
                            (LogitsSettings(repetition_penalty=0.0), "repetition_penalty"),
                            (LogitsSettings(logit_bias=((1, 101.0),)), "logit_bias"),
                            (LogitsSettings(logprobs=21), "logprobs")):
        with pytest.raises(PrunusError, match=words):
            settings.check()
    with pytest.raises(PrunusError, match=r"token 99; token ids lie in \[0, 40\)"):
        LogitsSettings(logit_bias=((99, 1.0),)).check(VOCAB)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("logits") / "model", stage="test")


def _tokens(engine, prompt: str, n: int, **kwargs) -> list[StreamToken]:
    request = engine.submit(prompt, n, **kwargs)
    out = []
    while True:
        event = request.events.get(timeout=60)
        if isinstance(event, StreamToken):
            out.append(event)
        elif isinstance(event, BaseException):
            raise event
        else:
            return out


def test_logprobs_equal_a_teacher_forced_pass(model_dir):
    """Greedy and sampled: each token's log-probability and top 4 are the log-softmax of the model's logits at
    that position (no bias or penalty), within 1e-4."""
    model = load_model(model_dir).eval()
    with Engine.load(model_dir, max_batch=2, threads=1) as engine:
        prompt = engine.encode("def f(x):")
        for kwargs in ({}, {"temperature": 0.9, "seed": 3}):
            made = _tokens(engine, prompt, 8, logits=LogitsSettings(logprobs=4), **kwargs)
            ids = prompt + [t.id for t in made]
            with torch.no_grad():
                want = torch.log_softmax(model(torch.tensor([ids])).float(), -1)[0, len(prompt) - 1:-1]
            for i, t in enumerate(made):
                assert abs(t.logprob.logprob - want[i, t.id].item()) < 1e-4
                values, top = torch.topk(want[i], 4)
                assert [k for k, _ in t.logprob.top] == top.tolist()
                assert max(abs(v - w) for (_, v), w in zip(t.logprob.top, values.tolist())) < 1e-4


def test_penalised_generation_equals_transformers_processors_step_by_step(model_dir):
    """The engine's greedy tokens under penalties, bias and min_tokens are the argmax of transformers'
    processors applied to the model's own logits at each step."""
    model = load_model(model_dir).eval()
    settings = LogitsSettings(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3,
                              logit_bias=((ord("e"), 2.0), (ord(" "), -3.0)), min_tokens=4)
    with Engine.load(model_dir, max_batch=2, threads=1) as engine:
        prompt = engine.encode("for i in range(")
        made = [t.id for t in _tokens(engine, prompt, 10, logits=settings)]
        stops = tuple(engine.tokenizer.stop_ids)
    ids = list(prompt)
    for token in made:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).float()[0, -1]
        want = reference(logits, settings, prompt, ids[len(prompt):], stops)
        assert token == int(want.argmax())
        ids.append(token)


def test_prompt_logprobs_need_the_model_in_this_process():
    from types import SimpleNamespace

    from prunus.runtime.backend import Capabilities
    from prunus.serve.http_guard import BadRequest
    from prunus.serve.prompt_logprobs import prompt_logprobs

    backend = SimpleNamespace(capabilities=Capabilities(max_batch=2))  # a backend that does not declare them
    engine = SimpleNamespace(backend=backend, info={"backend": "onnxruntime", "runtime": "native",
                                                              "native_isa": "avx2"})
    with pytest.raises(BadRequest, match=r"which prunus's native kernels \(avx2\) does not compute here") as e:
        prompt_logprobs(engine, [1, 2, 3], 1)
    assert e.value.status == 400 and e.value.param == "echo"
