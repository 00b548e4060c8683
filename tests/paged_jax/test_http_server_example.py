"""``examples/http_server.py``: a session behind real sockets and threads. Concurrent clients
get what ``generate`` gives them, a bad request is a 400 naming the field, a client that
hangs up mid-answer has its request aborted and its blocks freed, and an answer cut short
by the server's stop says so."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import threading
import time

import numpy as np
import pytest

from paged_jax import LLM, ChatTemplate, ModelConfig, SamplingParams, allocator, init_random

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location(
      "http_server_example", os.path.join(ROOT, "examples", "http_server.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def llm():
  config = ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=128, eos_token_ids=(2,))
  return LLM(init_random(config, seed=0, impl="xla"), config, block_size=4, num_blocks=64,
             max_seqs=3, max_tokens_per_step=16, steps_per_call=4)


def _post(port: int, body: dict) -> tuple[int, list[dict]]:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  conn.request("POST", "/generate", json.dumps(body))
  response = conn.getresponse()
  lines = [json.loads(line) for line in response.read().splitlines()]
  conn.close()
  return response.status, lines


def _wait_until(condition, timeout_s=60.0):
  end = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < end, "timed out"
    time.sleep(0.01)


def test_clients_at_once_get_generates_tokens_and_a_hang_up_is_aborted(example, llm):
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (5, 14, 9, 20, 3)]
  bodies = [dict(prompt=p, max_tokens=4 + i, temperature=0.7 * (i % 2), seed=i,
                 ignore_eos=True, logprobs=True, top_logprobs=i % 3)
            for i, p in enumerate(prompts)]
  bodies[1]["prompt_logprobs"] = 2
  expected = llm.generate(prompts, [SamplingParams(**{k: v for k, v in b.items()
                                                      if k != "prompt"}) for b in bodies])
  llm_outputs_n2 = [o.token_ids for o in llm.generate(
      [prompts[0]], SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=9,
                                   ignore_eos=True))]
  chat_want = llm.generate([[4, 7, 8, 5]], SamplingParams(max_tokens=3, ignore_eos=True)
                           )[0].token_ids  # the laid-out conversation below
  begun_want = llm.generate([[4, 7, 8, 4, 9]], SamplingParams(max_tokens=3, ignore_eos=True)
                            )[0].token_ids  # the same continued after a begun reply
  server, loop = example.serve(llm, port=0)
  port = server.server_address[1]
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    results = [None] * len(bodies)

    def client(i):
      results[i] = _post(port, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    for (status, lines), want in zip(results, expected):
      assert status == 200
      assert [line["token_id"] for line in lines[:-1]] == want.token_ids
      assert [line.get("top_logprobs") for line in lines[:-1]] == (
          [None] * len(want.token_ids) if want.top_logprobs is None
          else [[[i, lp] for i, lp in top.items()] for top in want.top_logprobs])
      assert lines[-1]["finish_reason"] == "length"
      assert lines[0].get("prompt_logprobs") == want.prompt_logprobs  # first line only
      assert all("prompt_logprobs" not in line for line in lines[1:])
      tops = want.prompt_top_logprobs
      assert lines[0].get("prompt_top_logprobs") == (
          None if tops is None else [None] + [[[i, lp] for i, lp in top.items()]
                                              for top in tops[1:]])

    # n = 2: both completions, interleaved as they come, the answer ends after the second.
    status, lines = _post(port, dict(prompt=prompts[0], max_tokens=3, n=2, temperature=1.0,
                                     seed=9, ignore_eos=True))
    want = llm_outputs_n2
    got = [[line["token_id"] for line in lines if line["index"] == f and "token_id" in line]
           for f in (0, 1)]
    assert status == 200 and got == want
    assert [line["finish_reason"] for line in lines if "finish_reason" in line] == ["length"] * 2

    # logit_bias as OpenAI's JSON has it, its ids as strings; a key no id is a 400.
    status, lines = _post(port, dict(prompt=prompts[1], max_tokens=3, ignore_eos=True,
                                     logit_bias={"42": 100, "7": -5.5}))
    assert status == 200 and [line.get("token_id") for line in lines] == [42, 42, 42, None]
    for bias, error in (({"x": 1}, "logit_bias key 'x' must be a token id"),
                        ({"-1": 1}, "logit_bias key -1 must be a token id, an int >= 0"),
                        ({"5": 1, "05": 2}, "names a token id twice")):
      status, lines = _post(port, dict(prompt=prompts[1], logit_bias=bias))
      assert status == 400 and error in lines[0]["error"], lines

    status, lines = _post(port, dict(prompt=[], max_tokens=3))
    assert status == 400 and "prompts[0]" in lines[0]["error"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", "{prompt")
    response = conn.getresponse()
    assert response.status == 400 and b"the body is not JSON" in response.read()
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.putrequest("POST", "/generate")
    conn.putheader("Content-Length", "-1")  # read to the end: a client could hold it open
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 400 and b"Content-Length='-1'" in response.read()
    conn.close()
    status, lines = _post(port, dict(prompt=[5], max_tokenz=3))
    assert status == 400 and "unknown fields ['max_tokenz']" in lines[0]["error"]

    # A conversation ("messages") is laid out by the model's chat template (this engine has
    # neither tokenizer nor template: refused, then given both for a moment).
    chat = dict(messages=[{"role": "user", "content": "w7 w8"}], max_tokens=3,
                ignore_eos=True)
    status, lines = _post(port, chat)
    assert status == 400 and "chat needs the engine's tokenizer" in lines[0]["error"]
    for body, error in ((dict(chat, prompt=[5]), "with a 'prompt' or a 'messages' (one of"),
                        (dict(max_tokens=3), "with a 'prompt' or a 'messages' (one of"),
                        (dict(chat, messages=[]), "'messages' must be one conversation")):
      status, lines = _post(port, body)
      assert status == 400 and error in lines[0]["error"], lines
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    llm.tokenizer, llm.chat_template = tok, ChatTemplate(
        "{% for m in messages %}w4 {{ m['content'] }} {% endfor %}w5")
    try:
      status, lines = _post(port, chat)
      assert status == 200 and [line.get("token_id") for line in lines] == chat_want + [None]
      status, lines = _post(port, dict(chat, messages=[{"content": "w7"}]))
      assert status == 400 and "must be a dict with a 'role'" in lines[0]["error"]
      # A reply begun ("w9") is continued: the prompt ends right after it.
      begun = dict(chat, messages=chat["messages"] + [{"role": "assistant", "content": "w9"}],
                   continue_final_message=True)
      status, lines = _post(port, begun)
      assert status == 200 and [line.get("token_id") for line in lines] == begun_want + [None]
      for body, error in ((dict(begun, add_generation_prompt=True), "pass add_generation"),
                          (dict(begun, continue_final_message=1), "must be true or false"),
                          (dict(prompt=[5], continue_final_message=True), "a 'prompt' has")):
        status, lines = _post(port, body)
        assert status == 400 and error in lines[0]["error"], lines
    finally:
      llm.tokenizer, llm.chat_template = None, None

    # A client reads one line of a long answer and hangs up: its request is aborted.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", json.dumps(dict(prompt=prompts[1], max_tokens=100,
                                                      ignore_eos=True)))
    response = conn.getresponse()
    assert "token_id" in json.loads(response.readline())
    conn.close()
    response.close()
    _wait_until(lambda: loop.aborted and not loop.session.num_unfinished)
    assert loop.aborted == 1

    # The server stops while an answer streams: the answer ends with an error line.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", json.dumps(dict(prompt=prompts[1], max_tokens=110,
                                                      ignore_eos=True)))
    response = conn.getresponse()
    assert "token_id" in json.loads(response.readline())
    with loop._lock:  # the loop delivers one more step at most before it sees the stop
      closer = threading.Thread(target=loop.close)
      closer.start()
      time.sleep(0.05)
    closer.join()
    rest = [json.loads(line) for line in response.read().splitlines()]
    conn.close()
    assert rest[-1] == {"error": "the server is shutting down"}
    assert not any("finish_reason" in line for line in rest)
  finally:
    server.shutdown()
    server.server_close()
    loop.close()
  assert loop.error is None
  allocator.validate(llm.allocator_state)
  assert llm.stats["num_free_blocks"] == llm.stats["num_blocks"]
