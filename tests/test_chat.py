"""Hugging Face tokenizers and chat: chat templates rendered exactly as transformers renders them (real
templates of the ChatML / Llama 3 / Mistral / Gemma / Zephyr families, every way a template is stored), stop
tokens from generation_config.json in models.generate, the Engine, `prunus generate --chat` and an
OpenAI-compatible /v1/chat/completions on a real server on 127.0.0.1 (streamed and not); tokenizer files
kept through convert --from-hf / --to-hf; bad input as one line, exit code 2 or HTTP 400; hostile templates
(huge strings, endless loops, recursion, strftime_now formats) bounded: one line, exit code 2 or HTTP 400, and
the server keeps serving."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from datetime import datetime

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.models import HFTokenizer, PrunusError, Transformer, get_preset, load_model, save_model, stream_tokens
from prunus.artifacts.atomic import atomic_write_json
from prunus.models.chat_template import render_chat
from prunus.models.model_dir import load_model_tokenizer, read_manifest, sha256_file
from prunus.serve import Engine
from prunus.serve.http_server import CompletionServer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Chat templates as the model families ship them (SmolLM2 / Qwen2 ChatML, Llama 3, Mistral v0.2, Gemma 2, Zephyr)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
         "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
         "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] "
           "== 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
           "roles are supported!') }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# the environment's extras: tojson (no HTML escaping), strftime_now, namespace, dict, break/continue, generation blocks
EXTRAS = """{% set ns = namespace(users=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.users = ns.users + 1 %}
    {% generation %}{{ m | tojson }}{% endgeneration %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{{ ns.users }} {{ dict(a=1) | tojson(indent=2) }} {{ strftime_now('%Y-%m-%d') }} {{ unk_token }}|{{ pad_token }}"""
TEMPLATES = {"smollm2": SMOLLM2, "qwen2": QWEN2, "llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA, "zephyr": ZEPHYR,
             "extras": EXTRAS}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
ADDED = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|system|>", "<|assistant|>", "[INST]", "[/INST]"]
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "  Say <b>\"é\"</b> & 'ok'\n  "}, {"role": "assistant", "content": "<b>\"é\"</b> & 'ok'"},
     {"role": "user", "content": "Again, line\nby line."}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Bye"}],
]
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}{% endfor %}" + SMOLLM2)


def bpe_tokenizer(extra: int = 0):
    """A byte-level BPE tokenizer trained on a few sentences, with the special tokens the templates use
    (and ``extra`` added tokens)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIAL.values(), *ADDED],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hello there, what is the answer? Be brief and say it again, line by line."] * 20, trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(extra)])
    return tok


def hf_tokenizer_dir(path, template: str | None, *, extra: int = 0, **files):
    """A Hugging Face tokenizer dir as transformers 5 saves it (the template in chat_template.jinja), plus ``files``."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(extra), **SPECIAL,
                                                chat_template=template)
    fast.save_pretrained(path)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content) if isinstance(content, dict) else content)
    return path


def hf_llama(path, **config):
    """A tiny random LlamaForCausalLM saved at ``path`` (config.json, model.safetensors, generation_config.json)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=320, max_position_embeddings=128, **config)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def assert_renders_like_transformers(ours: HFTokenizer, path, chats=CHATS):
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for chat in chats:
        for gen in (True, False):
            try:
                ref = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # the template refuses this conversation: we must refuse it with its message
                with pytest.raises(PrunusError, match="failed to render") as err:
                    ours.apply_chat_template(chat, add_generation_prompt=gen)
                assert str(e) in str(err.value)
                continue
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == ref
            ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert ours.encode(ref) == list(ids)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(tmp_path, name):
    path = hf_tokenizer_dir(tmp_path / "tok", TEMPLATES[name])
    assert (path / "chat_template.jinja").is_file()  # where transformers 5 keeps it
    ours = HFTokenizer(path)
    assert ours.chat_template == TEMPLATES[name] and ours.special_tokens == SPECIAL
    assert_renders_like_transformers(ours, path)
    if name == "extras":
        assert datetime.now().strftime("%Y-%m-%d") in ours.apply_chat_template(CHATS[0])


def test_every_way_a_template_and_special_tokens_are_stored(tmp_path):
    # tokenizer_config.json's chat_template as a string
    path = hf_tokenizer_dir(tmp_path / "str", None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    image = "{% if add_generation_prompt %}{{ image_token }}|{{ eot_token }}{% endif %}"  # model-specific tokens
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3 + image, "eot_token": "<|eot_id|>",
                                                            "extra_special_tokens": {"image_token": "<|im_start|>"}}))
    assert HFTokenizer(path).apply_chat_template(CHATS[0]).endswith("<|im_start|>|<|eot_id|>")
    assert_renders_like_transformers(HFTokenizer(path), path)
    # a list of named templates: "default" is used
    path = hf_tokenizer_dir(tmp_path / "list", None)
    named = [{"name": "default", "template": GEMMA}, {"name": "tool_use", "template": QWEN2}]
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    tok = HFTokenizer(path)
    assert tok.chat_templates == {"default": GEMMA, "tool_use": QWEN2}
    assert_renders_like_transformers(tok, path)
    # chat_template.jinja wins over the config's template, as in transformers
    (path / "chat_template.jinja").write_text(ZEPHYR)
    assert_renders_like_transformers(HFTokenizer(path), path)
    # special tokens only in special_tokens_map.json (older saves)
    path = hf_tokenizer_dir(tmp_path / "map", MISTRAL)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>", "special": True},
                                                              "eos_token": "</s>"}))
    tok = HFTokenizer(path)
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"} and tok.eos_id == tok.encode("</s>")[0]
    assert tok.apply_chat_template(CHATS[0]) == "<s>[INST] Hello there [/INST]"
    # named templates without a default, and no template at all, say so
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(PrunusError, match=r"named \['rag'\], none 'default'"):
        HFTokenizer(path).apply_chat_template(CHATS[0])
    (path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(PrunusError, match="no chat template"):
        HFTokenizer(path).apply_chat_template(CHATS[0])


def test_bad_messages_and_broken_templates_are_one_line():
    for messages, needle in [([], "non-empty list"), ("hi", "non-empty list"), ([{"content": "x"}], "'role' string"),
                             ([{"role": "user", "content": 3}], "'content' string"),
                             ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts")]:
        with pytest.raises(PrunusError, match=needle):
            render_chat(SMOLLM2, messages)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(SMOLLM2, parts).count("a\nb") == 1
    with pytest.raises(PrunusError, match=r"not valid Jinja \(line 1"):
        render_chat("{% for m in messages %}", CHATS[0])
    with pytest.raises(PrunusError, match="failed to render.*unknown"):
        render_chat("{{ messages[0].content.unknown() }}", CHATS[0])
    with pytest.raises(PrunusError, match="failed to render.*underscore"):  # the sandbox holds
        render_chat("{% set ns = namespace() %}{% set ns._x = 1 %}", CHATS[0])
    with pytest.raises(PrunusError, match="failed to render"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", CHATS[0])


def test_stop_tokens_from_tokenizer_config_and_generation_config(tmp_path):
    path = hf_tokenizer_dir(tmp_path / "tok", LLAMA3, **{"generation_config.json": {"eos_token_id": [5, 7], "bos_token_id": 0}})
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eot_token": "<|eot_id|>"}))
    tok = HFTokenizer(path)
    eos, eot = tok.encode("</s>")[0], tok.encode("<|eot_id|>")[0]
    assert tok.eos_id == eos and tok.stop_ids == (eos, eot, 5, 7)
    assert tok.generation.bos_token_id == 0 and tok.generation.eos_token_ids == (5, 7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(PrunusError, match="eos_token_id 'x' must be a token id"):
        HFTokenizer(path)


# --- a tiny chat model: generation, the CLI, the server -------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model dir, greedy tokens of the first chat's prompt with no stop tokens, k): a tiny model whose
    generation_config.json names as an end-of-turn token the token greedy decoding makes at step k."""
    root = tmp_path_factory.mktemp("chat")
    src = hf_tokenizer_dir(root / "tok", CHAT_TEMPLATE)
    tok = HFTokenizer(src)
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=256))
    model.init_weights()
    model.eval()
    prompt = tok.encode(tok.apply_chat_template(CHATS[1]))
    greedy = [int(t[0]) for t in stream_tokens(model, torch.tensor([prompt]), 40)]
    first_stop = next((i for i, t in enumerate(greedy) if t in tok.stop_ids), len(greedy))
    k = next(i for i in range(2, first_stop) if greedy[i] not in greedy[:i])
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, greedy[k]], "pad_token_id": 3}))
    return save_model(model, root / "model", tokenizer=HFTokenizer(src), stage="test"), greedy, k


def test_every_stop_token_ends_generation(chat_model):
    model_dir, greedy, k = chat_model
    tok = load_model_tokenizer(model_dir)
    assert greedy[k] in tok.stop_ids
    prompt = torch.tensor([tok.encode(tok.apply_chat_template(CHATS[1]))])
    out = [int(t[0]) for t in stream_tokens(load_model(model_dir), prompt, 40, eos_id=tok.stop_ids)]
    assert out == greedy[: k + 1]
    with Engine.load(model_dir, max_batch=2, threads=1) as engine:
        r = engine.generate(engine.chat_prompt(CHATS[1]), max_new_tokens=40)
        assert r.token_ids == greedy[:k] and r.finish_reason == "stop" and r.text == tok.decode(greedy[:k])
        assert engine.generate(engine.chat_prompt(CHATS[1]), max_new_tokens=40, ignore_eos=True).token_ids == greedy


def test_generate_chat_cli(chat_model, tmp_path, assert_user_error):
    model_dir, greedy, k = chat_model
    tok = load_model_tokenizer(model_dir)
    runner = CliRunner()
    r = runner.invoke(cli, ["generate", str(model_dir), "--chat", "--system", CHATS[1][0]["content"], "--prompt",
                            CHATS[1][1]["content"], "--temperature", "0", "--max-new-tokens", "40"])
    assert r.exit_code == 0, r.output
    assert r.stdout == tok.decode(greedy[:k]) + "\n" and "end of turn" in r.stderr
    assert_user_error(runner.invoke(cli, ["generate", str(model_dir), "--system", "x", "--prompt", "y"]), "--system")
    # a model without a template, a template that fails
    plain = save_model(load_model(model_dir), tmp_path / "plain", stage="test")  # byte tokenizer
    assert_user_error(runner.invoke(cli, ["generate", str(plain), "--chat", "--prompt", "hi"]), str(plain), "no chat template")
    src = hf_tokenizer_dir(tmp_path / "tok", "{{ raise_exception('Only user and assistant roles are supported!') }}")
    broken = save_model(load_model(model_dir), tmp_path / "broken", tokenizer=HFTokenizer(src), stage="test")
    assert_user_error(runner.invoke(cli, ["generate", str(broken), "--chat", "--prompt", "hi"]),
                      "failed to render", "Only user and assistant roles are supported!")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(chat_model, tmp_path, assert_user_error):
    model_dir, _, _ = chat_model
    big = hf_tokenizer_dir(tmp_path / "big", SMOLLM2, extra=40)
    assert HFTokenizer(big).n_vocab > 320
    with pytest.raises(PrunusError, match="vocab_size is 320"):  # nothing written
        save_model(load_model(model_dir), tmp_path / "out", tokenizer=HFTokenizer(big), stage="test")
    assert not (tmp_path / "out").exists()
    # a model dir whose tokenizer.json is too big (its manifest agreeing) is refused at load
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    shutil.copyfile(big / "tokenizer.json", bad / "tokenizer.json")
    manifest = read_manifest(bad)
    manifest["files"]["tokenizer.json"] = sha256_file(bad / "tokenizer.json")
    atomic_write_json(bad / "prunus.json", manifest)
    assert_user_error(CliRunner().invoke(cli, ["generate", str(bad), "--prompt", "hi"]), str(bad), "vocab_size is 320")
    # and so is a Hugging Face checkpoint whose tokenizer does not fit its config
    hf_llama(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(big / name, tmp_path / "hf" / name)
    assert_user_error(CliRunner().invoke(cli, ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]),
                      "tokenizer.json", "vocab_size is 320")
    assert not (tmp_path / "m").exists()


def test_convert_keeps_every_tokenizer_file(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_llama(hf_dir, pad_token_id=3, bos_token_id=0, eos_token_id=[1, 6])
    hf_tokenizer_dir(hf_dir, GEMMA, **{"special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>"}})
    runner = CliRunner()
    assert runner.invoke(cli, ["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "m")]).exit_code == 0
    assert runner.invoke(cli, ["convert", "--to-hf", str(tmp_path / "m"), "--out", str(tmp_path / "back")]).exit_code == 0
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
             "generation_config.json"]
    for name in names:
        assert (tmp_path / "back" / name).read_bytes() == (hf_dir / name).read_bytes(), name
    a, b = (transformers.AutoTokenizer.from_pretrained(p) for p in (hf_dir, tmp_path / "back"))
    assert b.apply_chat_template(CHATS[2], tokenize=False) == a.apply_chat_template(CHATS[2], tokenize=False)
    assert [b.bos_token, b.eos_token, b.unk_token, b.pad_token] == [a.bos_token, a.eos_token, a.unk_token, a.pad_token]
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "back")
    assert gen.eos_token_id == [1, 6] and gen.pad_token_id == 3 and gen.bos_token_id == 0
    assert HFTokenizer(tmp_path / "m").stop_ids == (1, 6)


# --- /v1/chat/completions ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_server(chat_model):
    model_dir, _, _ = chat_model
    with Engine.load(model_dir, max_batch=2, threads=1) as engine:
        server = CompletionServer(engine, port=0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        yield server.url
        server.shutdown()
        server.server_close()


def post(url: str, path: str, body) -> tuple[int, str, http.client.HTTPResponse]:
    """One POST; a JSON body names the served model, the dir's name (``model`` is required), unless it names one."""
    if isinstance(body, dict) and "model" not in body:
        body = {"model": "model", **body}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.getheader("Content-Type"), resp


def chat(url: str, body) -> tuple[int, dict]:
    status, _, resp = post(url, "/v1/chat/completions", body)
    return status, json.loads(resp.read())


def test_chat_completions(chat_server, chat_model):
    model_dir, greedy, k = chat_model
    tok = load_model_tokenizer(model_dir)
    status, r = chat(chat_server, {"messages": CHATS[1], "temperature": 0, "model": "model"})  # the dir's name
    assert status == 200 and r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    choice = r["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tok.decode(greedy[:k])} and choice["finish_reason"] == "stop"
    prompt_tokens = len(tok.encode(tok.apply_chat_template(CHATS[1])))
    # the end-of-turn token counts as a completion token, as in transformers' generate output
    assert r["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": k + 1, "total_tokens": prompt_tokens + k + 1}
    status, r = chat(chat_server, {"messages": CHATS[1], "temperature": 0, "max_tokens": 2})
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["message"]["content"] == tok.decode(greedy[:2])
    seeded = {"messages": CHATS[3], "temperature": 0.9, "top_p": 0.95, "seed": 3, "max_completion_tokens": 8}
    assert chat(chat_server, seeded)[1]["choices"] == chat(chat_server, seeded)[1]["choices"]


def test_chat_completions_streamed(chat_server, chat_model):
    model_dir, greedy, k = chat_model
    body = {"messages": CHATS[1], "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    status, ctype, resp = post(chat_server, "/v1/chat/completions", body)
    assert status == 200 and ctype == "text/event-stream"
    events = [line[6:] for line in resp.read().decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == k + 1  # end of turn too
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == load_model_tokenizer(model_dir).decode(greedy[:k])


def test_chat_completions_bad_input_is_400(chat_server, tmp_path, chat_model):
    cases = [(b"{nope", "not valid JSON"), ({"messages": []}, "non-empty list"), ({"max_tokens": 3}, "'messages'"),
             ({"messages": [{"role": "user"}]}, "'content' string"), ({"messages": CHATS[0], "tools": []}, "tools"),
             ({"messages": [{"role": "tool", "content": "42"}]}, "Unknown role: tool"),
             ({"messages": CHATS[0], "max_tokens": 10**6}, "exceeds the context"),
             ({"messages": CHATS[0], "n": 0}, "'n'"), ({"messages": CHATS[0], "stream": "yes"}, "'stream'")]
    for body, needle in cases:
        status, r = chat(chat_server, body)
        assert status == 400 and r["error"]["type"] == "invalid_request_error" and needle in r["error"]["message"], (body, r)
    assert chat(chat_server, {"messages": CHATS[0], "max_tokens": 1})[0] == 200  # still serving
    # a model without a chat template
    plain = save_model(load_model(chat_model[0]), tmp_path / "plain", stage="test")
    with Engine.load(plain, max_batch=1, threads=1) as engine:
        server = CompletionServer(engine, port=0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            status, r = chat(server.url, {"model": "plain", "messages": CHATS[0]})
            assert status == 400 and "no chat template" in r["error"]["message"]
        finally:
            server.shutdown()
            server.server_close()


# --- templates are code that comes with a model: bounded in size, work and time ------------------------------------

HOSTILE = [  # (template, words of the one-line error)
    ("{{ 'A' * 2000000000 }}", "str * int would make 2,000,000,000"),
    ("{{ ['A'] * 2000000000 }}", "list * int"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than 0.3 s"),
    ("{% for i in range(10**9) %}{% endfor %}", "range() of 1,000,000,000"),
    ("{{ strftime_now('%Y' * 1000000) }}", "strftime_now takes a format"),
    ("{{ strftime_now('%2000000000Y') }}", "without field widths"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ 'A'|center(2000000000) }}", "filter 'center'"),
    ("{{ ('\\n' * 1000000)|indent(1000) }}", "filter 'indent'"),
    ("{{ 'x'.ljust(2000000000) }}", "str.ljust()"),
    ("{{ ('\\t' * 100000).expandtabs(100000) }}", "str.expandtabs()"),
    ("{{ (' ' * 3000000).join(['a'] * 1000) }}", "str.join()"),
    ("{{ '{:>2000000000}'.format(1) }}", "str.format()"),
    ("{{ '%2000000000d' % 1 }}", "str % int"),
    ("{% set ns = namespace(s='A') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "~ operator"),
    ("{% set a = ['A' * 4000000] %}{% set b = [a, a, a, a] %}{{ b }}", "as text"),
    ("{% set a = ['A' * 4000000] %}{% set b = [a, a, a, a] %}{{ b|tojson }}", "filter 'tojson'"),
    ("{{ 'A' * 3000000 }}{{ 'A' * 3000000 }}", "rendered prompt is longer than"),
    ("{% macro m() %}{% for i in range(100) %}{{ 'A' * 1000000 }}{% endfor %}{% endmacro %}{% set x = m() %}", "in all"),
    ("{% set ns = namespace(x=3) %}{% for i in range(30) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "bits"),
    ("{{ lipsum(1000000000) }}", "'lipsum' is undefined"),
]


def _deadline_for(monkeypatch, words: str) -> None:
    """A short render deadline only where the deadline is what a case tests: elsewhere a loaded machine could
    reach it before the limit the case is about."""
    monkeypatch.setattr("prunus.models.template_sandbox.RENDER_TIMEOUT_S", 0.3 if "0.3 s" in words else 5.0)


def test_hostile_templates_are_bounded_one_line_errors(monkeypatch):
    for template, words in HOSTILE:
        _deadline_for(monkeypatch, words)
        t0 = time.monotonic()
        with pytest.raises(PrunusError) as e:
            render_chat(template, CHATS[0])
        message = str(e.value)
        assert message.startswith("the chat template failed to render") and words in message, (template, message)
        assert "\n" not in message and len(message) < 400 and time.monotonic() - t0 < 6, template
    with pytest.raises(PrunusError, match="bad bad") as e:  # the template's own message, cut to one short line
        render_chat("{{ raise_exception('bad\\n' * 100000) }}", CHATS[0])
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    # what real templates do stays well inside the bounds
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200} for i in range(400)]
    assert render_chat(SMOLLM2, long_chat).count("<|im_start|>") == 402


HOSTILE_CHAT = ("{% set asked = messages[-1]['content'] %}"
                "{% if asked == 'huge' %}{{ 'A' * 2000000000 }}"
                "{% elif asked == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}"
                "{% elif asked == 'range' %}{% for i in range(10**9) %}{% endfor %}"
                "{% elif asked == 'date' %}{{ strftime_now('%Y' * 1000000) }}"
                "{% elif asked == 'recurse' %}{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"
                "{% else %}" + SMOLLM2 + "{% endif %}")


@pytest.fixture
def hostile_model(chat_model, tmp_path):
    src = hf_tokenizer_dir(tmp_path / "tok", HOSTILE_CHAT)
    return save_model(load_model(chat_model[0]), tmp_path / "hostile", tokenizer=HFTokenizer(src), stage="test")


def test_a_hostile_template_is_400_and_the_server_keeps_serving(hostile_model, monkeypatch):
    with Engine.load(hostile_model, max_batch=1, threads=1) as engine:
        server = CompletionServer(engine, port=0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            for asked, words in [("huge", "2,000,000,000"), ("loop", "longer than 0.3 s"), ("range", "range()"),
                                 ("date", "strftime_now"), ("recurse", "RecursionError")]:
                _deadline_for(monkeypatch, words)
                t0 = time.monotonic()
                status, r = chat(server.url, {"model": "hostile", "messages": [{"role": "user", "content": asked}],
                                              "max_tokens": 1})
                assert status == 400 and r["error"]["type"] == "invalid_request_error", (asked, r)
                assert words in r["error"]["message"] and time.monotonic() - t0 < 8, (asked, r)
            status, r = chat(server.url, {"model": "hostile", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2})
            assert status == 200 and r["choices"][0]["finish_reason"] in ("length", "stop")
        finally:
            server.shutdown()
            server.server_close()


def test_generate_chat_with_a_hostile_template_exits_2(hostile_model, assert_user_error, monkeypatch):
    for asked, words in [("loop", "longer than 0.3 s"), ("huge", "2,000,000,000")]:
        _deadline_for(monkeypatch, words)
        r = CliRunner().invoke(cli, ["generate", str(hostile_model), "--chat", "--prompt", asked, "--max-new-tokens", "1"])
        assert_user_error(r, "failed to render", words)
