"""A small HTTP server over ``LLM.session()``: each request joins the batch already running.

    python examples/http_server.py --port 8000                # the embedded tiny model
    python examples/http_server.py --port 8000 --model DIR    # a checkpoint (text prompts)
    curl -N localhost:8000/generate -d '{"prompt": [5, 6, 7], "max_tokens": 8}'

``POST /generate`` takes a JSON object: ``prompt`` (token ids, or text when the model has a
tokenizer) or ``messages`` (one conversation, ``[{"role": "user", "content": ...}]``, laid
out by the checkpoint's chat template as ``LLM.chat`` does; ``"continue_final_message": true``
continues its last message, ``"add_generation_prompt"`` as there) and any ``SamplingParams`` field
(``max_tokens``, ``temperature``, ``stop``, ...; ``logit_bias`` as OpenAI's, ``{"token id":
bias}``).
The answer streams one JSON line per event as the engine decides it: ``{"index": 0,
"token_id": 17, "text": ..., "logprob": ...}`` per token (with ``"top_logprobs": [[id,
logprob], ...]`` when asked; a completion's first line with ``"prompt_logprobs"`` and
``"prompt_top_logprobs"`` when ``prompt_logprobs`` asks), then ``{"index": 0,
"finish_reason": "length", ...}`` (``index``: the completion, 0 .. n-1 with ``n``); an
answer cut short (the server stopping) ends with an ``{"error": ...}`` line. A bad request is a 400
with the engine's ``ValueError`` message. A client that goes away mid-answer has its request
aborted: its slot and blocks are freed at the next step.

One thread (``EngineLoop``) steps the session while any request is unfinished; the
server's handler threads add requests and read their events from a queue each. Standard
library only besides paged_jax: it shows the session's use, it is not a production server.
"""

from __future__ import annotations

import argparse
import http.server
import json
import queue
import re
import threading

from paged_jax import LLM, SamplingParams
from paged_jax.engine.chat import chat_prompts

MAX_BODY_BYTES = 1 << 20
CHAT_LAYOUT = ("add_generation_prompt", "continue_final_message")


class EngineLoop:
  """Steps ``llm``'s session in a thread of its own; ``submit`` / ``abort`` from any thread."""

  def __init__(self, llm: LLM):
    self.llm, self.session = llm, llm.session()
    self.aborted = 0  # requests aborted because their client went away
    self.error: BaseException | None = None
    self._queues: dict[int, queue.Queue] = {}
    self._left: dict[int, int] = {}  # completions not yet ended, by request id
    self._lock = threading.Lock()  # a request's queue is registered before its first event
    self._wake, self._stop = threading.Event(), False
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._thread.start()

  def submit(self, prompt, params: SamplingParams) -> tuple[int, queue.Queue]:
    """Add one request; its events arrive on the queue returned, None after its last (or
    after an error of the loop, in ``error``). A bad request raises ``ValueError``."""
    events: queue.Queue = queue.Queue()
    with self._lock:
      if self.error is not None or self._stop:
        raise RuntimeError("the engine loop has stopped")
      request_id, = self.session.add([prompt], params)
      self._queues[request_id], self._left[request_id] = events, params.n
    self._wake.set()
    return request_id, events

  def abort(self, request_id: int) -> None:
    try:
      self.session.abort(request_id)
    except RuntimeError:  # the session is closed: nothing left to drop
      return
    self.aborted += 1
    self._wake.set()

  def _run(self) -> None:
    try:
      while not self._stop:
        if not self.session.num_unfinished:
          self._wake.wait(0.05)  # a submit sets it: no step while nothing is asked
          self._wake.clear()
          continue
        events = self.session.step()
        with self._lock:
          for ev in events:
            events_queue = self._queues.get(ev.prompt_index)
            if events_queue is None:
              continue
            events_queue.put(ev)
            if ev.token_id is None:
              self._left[ev.prompt_index] -= 1
              if not self._left[ev.prompt_index]:  # its last completion ended
                events_queue.put(None)
                del self._queues[ev.prompt_index], self._left[ev.prompt_index]
    except BaseException as e:  # the session is closed: every waiting handler is told
      self.error = e
    with self._lock:
      for events_queue in self._queues.values():
        events_queue.put(None)
      self._queues.clear()

  def close(self) -> None:
    self._stop = True
    self._wake.set()
    self._thread.join()
    self.session.close()


def make_handler(loop: EngineLoop):
  fields = set(SamplingParams.__dataclass_fields__)

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: a stream
    timeout = 60  # seconds a client may stall (sending its body, or reading the answer)

    def log_message(self, *args):  # quiet: one line per request is noise here
      pass

    def _refuse(self, code: int, message: str) -> None:
      body = json.dumps({"error": message}).encode() + b"\n"
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_POST(self):
      if self.path != "/generate":
        return self._refuse(404, f"no {self.path}: POST /generate")
      length = self.headers.get("Content-Length", "")
      if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        return self._refuse(400, f"Content-Length={length!r} must be a byte count up to "
                            f"{MAX_BODY_BYTES}")
      try:
        try:
          body = json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, RecursionError) as e:
          raise ValueError(f"the body is not JSON we read ({e})") from None
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
          raise ValueError("the body must be a JSON object with a 'prompt' or a 'messages' "
                           "(one of them)")
        # How the conversation is laid out (``LLM.chat``'s): with "messages" only.
        layout = {k: body.pop(k) for k in CHAT_LAYOUT if k in body}
        if layout and "messages" not in body:
          raise ValueError(f"{sorted(layout)} lay out 'messages': a 'prompt' has none")
        if not all(isinstance(v, bool) for v in layout.values()):
          raise ValueError(f"{layout} must be true or false")
        unknown = sorted(set(body) - fields - {"prompt", "messages"})
        if unknown:
          raise ValueError(f"unknown fields {unknown}: 'prompt' or 'messages' and "
                           f"SamplingParams' fields {sorted(fields)}")
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in body.items()
                  if k not in ("prompt", "messages")}
        prompt = body.get("prompt")
        if "messages" in body:  # one conversation, laid out by the chat template
          if not isinstance(body["messages"], list) or not body["messages"]:
            raise ValueError("'messages' must be one conversation: a non-empty list of "
                             "{\"role\": ..., \"content\": ...} objects")
          cont = layout.get("continue_final_message", False)
          prompt, = chat_prompts(
              loop.llm.tokenizer, loop.llm.chat_template, [body["messages"]],
              add_generation_prompt=layout.get("add_generation_prompt", not cont),
              continue_final_message=cont)
        if isinstance(params.get("logit_bias"), dict):  # JSON's keys are strings: ids here
          # As pairs, so that "5" and "05" are one id named twice, not one silently lost.
          params["logit_bias"] = [(int(k) if re.fullmatch(r"-?[0-9]{1,10}", k) else k, v)
                                  for k, v in params["logit_bias"].items()]
        request_id, events = loop.submit(prompt, SamplingParams(**params))
      except ValueError as e:  # a bad JSON body or request: the engine's own message
        return self._refuse(400, str(e))
      except RuntimeError as e:
        return self._refuse(503, str(e))
      try:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        ended = 0
        while (ev := events.get()) is not None:
          if ev.token_id is not None:
            line = {"index": ev.sample_index, "token_id": ev.token_id, "text": ev.text,
                    "logprob": ev.logprob}
            if ev.top_logprobs is not None:  # [id, logprob] pairs, most likely first
              line["top_logprobs"] = [list(pair) for pair in ev.top_logprobs.items()]
          else:
            ended += 1
            line = {"index": ev.sample_index, "finish_reason": ev.finish_reason,
                    "stop_reason": ev.stop_reason, "text": ev.text}
          if ev.prompt_logprobs is not None:  # a completion's first line (prompt_logprobs)
            line["prompt_logprobs"] = ev.prompt_logprobs
            if ev.prompt_top_logprobs is not None:
              line["prompt_top_logprobs"] = [None if top is None else [
                  list(pair) for pair in top.items()] for top in ev.prompt_top_logprobs]
          self.wfile.write(json.dumps(line).encode() + b"\n")
          self.wfile.flush()
        if ended < params.get("n", 1):  # the loop stopped first: say so, not a silent end
          why = "the server is shutting down" if loop.error is None else repr(loop.error)
          self.wfile.write(json.dumps({"error": why}).encode() + b"\n")
      except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away
        loop.abort(request_id)

  return Handler


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000):
  """The server (not yet serving: call ``serve_forever``) and its engine loop."""
  loop = EngineLoop(llm)
  server = http.server.ThreadingHTTPServer((host, port), make_handler(loop))
  server.daemon_threads = True
  return server, loop


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny "
                      "Llama of `paged-jax run`, random weights, token-id prompts only)")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--max-seqs", type=int, default=16)
  args = parser.parse_args(argv)
  if args.model:
    llm = LLM.from_pretrained(args.model, max_seqs=args.max_seqs)
  else:
    from paged_jax import ModelConfig, init_random
    config = ModelConfig(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         max_seq_len=512, eos_token_ids=(2,))
    llm = LLM(init_random(config, seed=0), config, num_blocks=256, max_seqs=args.max_seqs)
  print("compiling ...", flush=True)
  llm.precompile()
  server, loop = serve(llm, args.host, args.port)
  print(f"serving on http://{args.host}:{server.server_address[1]}/generate", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    loop.close()


if __name__ == "__main__":
  main()
