"""`strata tokenize` of chat JSONL against apply_chat_template(messages, tokenize=True) (issue 44).

For the published chat templates of Llama 3 / 3.1, Qwen 2.5, Qwen 3 (thinking on and off),
Gemma 3, Mistral v0.1 / v3, Phi-4, DeepSeek V3 and a ChatML fine-tune with {% generation %}
blocks (jinja_chat_templates.py), the test writes a model directory per family — a small
byte-level BPE tokenizer.json with the family's special tokens as added tokens and a
tokenizer_config.json with its chat_template, bos_token and eos_token — and a JSONL file of
conversations (system, user and assistant turns, several turns, CJK / Cyrillic / emoji with
ZWJ, contents beginning or ending with "\\n" and "\\n\\n", prompt/response lines, tools, Qwen 3
reasoning). It runs `strata tokenize --tokenizer DIR` and compares, token for token:

- the ids with the reference: the conversation rendered by jinja2 configured as transformers
  configures it (jinja_reference.py, add_generation_prompt false) and encoded as HF tokenizers
  encodes it with that tokenizer.json (RefBpe below: added tokens split out leftmost-longest,
  the file's Split regex, bytes_to_unicode, merges by rank);
- the loss flags with the reference mask: the {% generation %} spans where the template has
  them, else the prefix-render rule as data/instruction_data.h states it (written here from the
  header's text); a token is flagged when any of its bytes lies in a span;
- that the flagged text is, per assistant message, what the family's model generates: its
  rendered content and its end-of-turn token (expected_turn_text, per family);
- the example-start flag on each line's first token, and nothing else.

A Mistral line whose roles do not alternate must fail with one line naming the file and line
and write no output. Exits 77 (CTest SKIP_RETURN_CODE) without jinja2 or without STRATA_CLI.
"""

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import jinja_reference
    from jinja_chat_templates import TEMPLATES
except ImportError as _e:  # jinja2 missing: the __main__ block reports this and exits 77
    jinja_reference = None
    _IMPORT_ERROR = _e

SKIP = 77
CLI = os.environ.get("STRATA_CLI", "")
NOW = 1721995200  # strftime_now is not reached: Llama 3.1 gets date_string as a kwarg

# ---------------------------------------------------------------------------------------------
# The reference tokenizer: HF tokenizers' byte-level BPE, written from its documented behaviour
# (AddedVocabulary splits the added tokens out of the raw text first, leftmost-longest; each
# remaining piece goes through the pre-tokenizer; ByteLevel maps bytes through GPT-2's
# bytes_to_unicode; BPE merges the lowest-ranked adjacent pair, all its occurrences left to
# right, until no pair has a rank).


def bytes_to_unicode():
    """GPT-2's table (Radford et al. 2019, encoder.py): printable bytes map to themselves, the
    others to 256 + n in byte order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()
U2B = {u: b for b, u in B2U.items()}


def bl(s):
    """A text's byte-level spelling ("\\n\\n" -> "ĊĊ", " the" -> "Ġthe")."""
    return "".join(B2U[b] for b in s.encode("utf-8"))


# Words whose merges the tokenizers carry, learnt left to right so that every merge's parts are
# earlier merges (as BPE training orders them): "\n\n" merges across a role header and a content
# that starts with "\n"; " is", "It", "user" ... merge; one merge crosses the boundary of two CJK
# characters (a token holding parts of two characters), one joins the lead bytes of an emoji.
MERGE_WORDS = [
    "\n\n", "\n\n\n", " t", "he", " the", " is", "It", " It", "er", "us", "user", "as", "si", "st",
    "an", "ant", "assi", "assist", "assistant", "sy", "sys", "te", "tem", "system", "mo", "de",
    "mode", "model", " 4", ".\n", " a", "at", " W", "ha", "hat", " What", " you", " are", " 2",
    "+2", b"\xe4\xb8", b"\x96\xe7", "п", "р", b"\xf0\x9f", b"\xf0\x9f\x91",
]


def merges_of(words):
    """Rank-ordered merges that make each word (text, or bytes: a part of a character) one token:
    the word is encoded with the merges before it, and its pieces are joined left to right
    ("user" after "er" and "us": "us er"), as BPE training orders its merges."""
    merges = []
    for w in words:
        syms = [B2U[b] for b in (w if isinstance(w, bytes) else w.encode("utf-8"))]
        ranks = {m: r for r, m in enumerate(merges)}
        syms = _merge(syms, ranks, merges)
        while len(syms) > 1:
            merges.append((syms[0], syms[1]))
            syms = [syms[0] + syms[1]] + syms[2:]
    return merges


def _merge(syms, ranks, merges):
    """BPE on a list of symbols: the lowest-ranked adjacent pair, all its occurrences left to
    right, until no adjacent pair has a rank (HF's Word::merge_all gives the same for merges
    ordered as training orders them)."""
    while len(syms) > 1:
        ranked = [ranks[p] for p in zip(syms, syms[1:]) if p in ranks]
        if not ranked:
            break
        best, out, k = merges[min(ranked)], [], 0
        while k < len(syms):
            if k + 1 < len(syms) and (syms[k], syms[k + 1]) == best:
                out.append(syms[k] + syms[k + 1])
                k += 2
            else:
                out.append(syms[k])
                k += 1
        syms = out
    return syms


class RefBpe:
    """Encodes as HF tokenizers does for the tokenizer.json that to_json() writes."""

    def __init__(self, added, split_regex=None, non_special=()):
        self.merges = merges_of(MERGE_WORDS)
        self.ranks = {m: r for r, m in enumerate(self.merges)}
        self.vocab = {B2U[b]: i for i, b in enumerate(sorted(B2U, key=lambda b: ord(B2U[b])))}
        for a, b in self.merges:
            self.vocab.setdefault(a + b, len(self.vocab))
        self.added = {t: len(self.vocab) + i for i, t in enumerate(added)}
        self.non_special = set(non_special)
        self.split_regex = split_regex
        self.id_to_piece = {i: p for p, i in self.vocab.items()}
        self.id_to_piece.update({i: t for t, i in self.added.items()})

    def to_json(self):
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                      "use_regex": False}
        if self.split_regex is None:
            pre = byte_level
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.split_regex},
                 "behavior": "Isolated", "invert": False}, byte_level]}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False,
                              "special": t not in self.non_special}
                             for t, i in self.added.items()],
            "normalizer": None, "pre_tokenizer": pre, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": self.vocab, "merges": [a + " " + b for a, b in self.merges]},
        }

    def _bpe(self, piece, at):
        """(id, begin, end) of a pre-token's bytes starting at byte `at` (a byte-level symbol
        is one byte)."""
        out = []
        for sym in _merge([B2U[b] for b in piece.encode("utf-8")], self.ranks, self.merges):
            out.append((self.vocab[sym], at, at + len(sym)))
            at += len(sym)
        return out

    def _pretokenize(self, text):
        """Split(Regex, Isolated): the matches and the text between them, in order."""
        if self.split_regex is None:
            return [(0, len(text))]
        pieces, last = [], 0
        for m in re.finditer(self.split_regex, text):
            if m.start() > last:
                pieces.append((last, m.start()))
            if m.end() > m.start():
                pieces.append((m.start(), m.end()))
            last = m.end()
        if last < len(text):
            pieces.append((last, len(text)))
        return pieces

    def encode(self, text):
        """[(id, begin_byte, end_byte)] of text, as encode(add_special_tokens=False) with
        return_offsets_mapping (in bytes)."""
        byte_at = [0]
        for c in text:
            byte_at.append(byte_at[-1] + len(c.encode("utf-8")))
        out, i, seg = [], 0, 0

        def flush(end):
            for b, e in self._pretokenize(text[seg:end]):
                out.extend(self._bpe(text[seg + b:seg + e], byte_at[seg + b]))

        while i < len(text):
            hits = [t for t in self.added if text.startswith(t, i)]
            if not hits:
                i += 1
                continue
            tok = max(hits, key=len)
            flush(i)
            out.append((self.added[tok], byte_at[i], byte_at[i + len(tok)]))
            i += len(tok)
            seg = i
        flush(len(text))
        return out

    def decode(self, ids):
        """The bytes of ids (ByteLevel decoder; added tokens as their text)."""
        out = bytearray()
        for i in ids:
            p = self.id_to_piece[i]
            out += p.encode("utf-8") if p in self.added else bytes(U2B[c] for c in p)
        return bytes(out)


# Llama 3's pre-tokenizer pattern with ASCII classes for \p{L} / \p{N} / \s (so Python's re and
# the engine's PCRE2 read it alike): "\n\n" is one pre-token, " What" another, a CJK run one.
LLAMA_STYLE_SPLIT = (r"'(?:s|t|re|ve|m|ll|d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
                     r"| ?[^ \t\r\nA-Za-z0-9]+[\r\n]*|[ \t\r\n]*[\r\n]+|[ \t\r\n]+(?![^ \t\r\n])"
                     r"|[ \t\r\n]+")

# ---------------------------------------------------------------------------------------------
# Families: template, special tokens, config tokens, pre-tokenizer, and what a turn's loss text
# is for the family's model.

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = CHATML_SPECIALS + ["<tool_call>", "</tool_call>"]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                     "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                     "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]


def _strip(s):
    return s.strip()  # Jinja's trim: Python's str.strip()


def _tool_call_llama31(m):
    f = m["tool_calls"][0]["function"]
    return '{"name": "' + f["name"] + '", "parameters": ' + json.dumps(
        f["arguments"], ensure_ascii=False) + "}"


def _tool_calls_qwen(m):
    """Past the generation prompt "<|im_start|>assistant\\n", which holds the first "\\n"."""
    out = "\n" + m["content"] if m.get("content") else ""
    for tc in m["tool_calls"]:
        f = tc["function"]
        out += ('\n<tool_call>\n{"name": "' + f["name"] + '", "arguments": '
                + json.dumps(f["arguments"], ensure_ascii=False) + "}\n</tool_call>")
    return out[1:]


def _qwen3_turn(m, last_turn_after_query, kwargs):
    """Qwen 3's assistant turn in the loss (see the template): the reasoning block of the turn
    after the last user query, the content, <|im_end|>."""
    content, reasoning = m["content"], m.get("reasoning_content")
    inline = not isinstance(reasoning, str) and "</think>" in content
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    if not last_turn_after_query:
        return content + "<|im_end|>"
    block = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
    if kwargs.get("enable_thinking") is False:
        # Thinking off: the generation prompt already holds "<think>\n\n</think>\n\n", so the
        # model generates no reasoning. A reasoning the line gives anyway makes the prompt no
        # prefix of the turn, and the turn then starts at its content (instruction_data.h):
        # reasoning "4 times 5." gives "20<|im_end|>". Reasoning inline in the content goes with
        # the content when it is emptied, so there the turn starts after "<think>\n" (measured:
        # "6*7 is 42.\n</think>\n\nForty-two.<|im_end|>").
        block = block[len("<think>\n"):] if inline else ""
    return block + content.lstrip("\n") + "<|im_end|>"


FAMILIES = {
    "llama3": dict(template="llama3", added=LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                   eos="<|eot_id|>", split=LLAMA_STYLE_SPLIT,
                   turn=lambda m, **_: _strip(m["content"]) + "<|eot_id|>"),
    "llama3.1": dict(template="llama3.1", added=LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                     eos="<|eot_id|>", split=LLAMA_STYLE_SPLIT, tools=True,
                     kwargs={"date_string": "26 Jul 2024"},
                     turn=lambda m, **_: (_tool_call_llama31(m) if "tool_calls" in m
                                          else _strip(m["content"])) + "<|eot_id|>"),
    "qwen2.5": dict(template="qwen2.5", added=QWEN_ADDED, non_special=["<tool_call>",
                                                                         "</tool_call>"],
                    bos=None, eos="<|im_end|>", split=LLAMA_STYLE_SPLIT, tools=True,
                    turn=lambda m, **_: ((_tool_calls_qwen(m) if m.get("tool_calls")
                                          else m["content"]) + "<|im_end|>")),
    "qwen3": dict(template="qwen3", added=QWEN_ADDED + ["<think>", "</think>"],
                  non_special=["<tool_call>", "</tool_call>", "<think>", "</think>"],
                  bos=None, eos="<|im_end|>", split=LLAMA_STYLE_SPLIT, qwen3=True,
                  turn=lambda m, last_after_query, kwargs, **_: _qwen3_turn(
                      m, last_after_query, kwargs)),
    "gemma3": dict(template="gemma3",
                   added=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                   bos="<bos>", eos="<eos>", split=None,
                   turn=lambda m, **_: _strip(m["content"]) + "<end_of_turn>"),
    "mistral-v0.1": dict(template="mistral-v0.1", added=["<unk>", "<s>", "</s>", "[INST]",
                                                         "[/INST]"],
                         bos="<s>", eos="</s>", split=None, no_system=True,
                         turn=lambda m, **_: m["content"] + "</s>"),
    # Mistral v3 writes " " + content|trim + eos after [/INST]: the space is in the loss (it is
    # part of the turn the prefix renders find), one byte more than content|trim + "</s>". With a
    # system message the prompt is not a prefix of the turn and the turn starts at its content:
    # content|trim + "</s>" (the space then comes with the token straddling the start).
    "mistral-v3": dict(template="mistral-v3",
                       added=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                              "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                              "[/TOOL_RESULTS]"],
                       bos="<s>", eos="</s>", split=None,
                       turn=lambda m, line, **_: ("" if _has_system(line) else " ") +
                       _strip(m["content"]) + "</s>"),
    "phi4": dict(template="phi4", added=CHATML_SPECIALS + ["<|im_sep|>"], bos="<|endoftext|>",
                 eos="<|im_end|>", split=LLAMA_STYLE_SPLIT,
                 turn=lambda m, **_: m["content"] + "<|im_end|>"),
    "deepseek-v3": dict(template="deepseek-v3", added=DEEPSEEK_SPECIALS,
                        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", split=None,
                        turn=lambda m, **_: m["content"] + "<｜end▁of▁sentence｜>"),
    "chatml-generation": dict(template="chatml-generation", added=CHATML_SPECIALS,
                              bos=None, eos="<|im_end|>", split=None, generation=True,
                              turn=lambda m, **_: _strip(m["content"]) + "<|im_end|>"),
}

# ---------------------------------------------------------------------------------------------
# Conversations (JSON lines). Every assistant content is distinct, so a turn's text is found
# only where it is.

SYSTEM = "You are a helpful assistant."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place, \u00b0C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _m(role, content, **extra):
    return dict({"role": role, "content": content}, **extra)


def conversations(family):
    """(name, JSON object) lines for a family."""
    f = FAMILIES[family]
    lines = [
        ("system_user_assistant", {"messages": [
            _m("system", SYSTEM), _m("user", "What is 2+2?"), _m("assistant", "It is 4.")]}),
        ("multi_turn", {"messages": [
            _m("system", "Be brief."), _m("user", "Hi there"),
            _m("assistant", "Hello! How can I help?"),
            _m("user", "What is the capital of France?"), _m("assistant", "Paris is the capital."),
            _m("user", "And of Japan?"), _m("assistant", "Tokyo, the capital of Japan.")]}),
        ("non_ascii", {"messages": [
            _m("user", "Привет! Как сказать «мир» по-китайски? 你好"),
            _m("assistant", "世界 (shìjiè) — это «мир». 👩\u200d💻 👨\u200d👩\u200d👧 ✓")]}),
        ("newlines", {"messages": [
            _m("system", "\nAnswer plainly.\n"), _m("user", "\nWhat is 2+2?"),
            _m("assistant", "\n\nIt is 4."), _m("user", "Are you sure?\n\n"),
            _m("assistant", "Yes.\n\n"), _m("user", "\n\nThanks\n"),
            _m("assistant", "\nYou are welcome!\n")]}),
        ("prompt_response", {"prompt": "Name a colour.", "response": "Blue."}),
        ("prompt_response_system", {"system": SYSTEM, "prompt": "Say the word the.",
                                    "response": "the"}),
        ("user_assistant", {"messages": [_m("user", "2+2?"), _m("assistant", " 4 ")]}),
    ]
    if f.get("tools"):
        call = {"type": "function", "function": {"name": "get_weather",
                                                   "arguments": {"city": "Z\u00fcrich"}}}
        lines.append(("tools", {"messages": [
            _m("system", "Use tools."), _m("user", "Weather in Z\u00fcrich?"),
            _m("assistant", "It is sunny in Z\u00fcrich.")], "tools": [WEATHER_TOOL]}))
        lines.append(("tool_call", {"messages": [
            _m("user", "Weather in Paris?"), _m("assistant", None, tool_calls=[call]),
            _m("tool" if family != "llama3.1" else "ipython", "{\"temp\": 21}"),
            _m("assistant", "21 \u00b0C in Paris.")], "tools": [WEATHER_TOOL]}))
    if f.get("qwen3"):
        lines.append(("reasoning_content", {"messages": [
            _m("user", "Think: 3*7?"), _m("assistant", "21", reasoning_content="3*7 is 21."),
            _m("user", "And 4*5?"), _m("assistant", "20", reasoning_content="4 times 5.")]}))
        lines.append(("inline_think", {"messages": [
            _m("user", "Think: 6*7?"),
            _m("assistant", "<think>\n6*7 is 42.\n</think>\n\nForty-two.")]}))
    if f.get("no_system"):  # Mistral v0.1 takes user and assistant only
        lines = [(n, _without_system(c)) for n, c in lines]
    return lines


def _has_system(line):
    return "system" in line or any(m["role"] == "system" for m in line.get("messages", []))


def _without_system(line):
    line = {k: v for k, v in line.items() if k != "system"}
    if "messages" in line:
        line["messages"] = [m for m in line["messages"] if m["role"] != "system"]
    return line


def messages_of(line):
    if "messages" in line:
        return line["messages"]
    out = [_m("system", line["system"])] if "system" in line else []
    return out + [_m("user", line["prompt"]), _m("assistant", line["response"])]


# ---------------------------------------------------------------------------------------------
# The reference.


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prefix_spans(render, messages, whole):
    """data/instruction_data.h's rule, from its text. P = messages [0, k) rendered with
    add_generation_prompt, T = [0, k] without, W = the whole conversation. Where P is a prefix of
    T, the turn's text is T past P less trailing ASCII whitespace; it starts where W stops
    agreeing with P (not before the previous turn's end) and ends after the text where W holds it
    there, else after the longest suffix of it W holds from the start on. Where P is not a prefix
    of T, the text is T past its common prefix with T rendered with message k's content "", and
    the span is the longest suffix of it W holds after the previous turn. Bytes throughout."""
    spans, prev_end = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:k], True)
        turn = render(messages[:k + 1], False)
        agrees = turn.startswith(prompt)
        if agrees:
            turn_start = len(prompt)
        else:
            turn_start = lcp(turn, render(messages[:k] + [dict(m, content="")], False))
        text = turn[turn_start:].rstrip(b" \t\n\r")
        start = max(prev_end, lcp(whole, prompt))
        if agrees and whole.startswith(text, start):
            end = start + len(text)
        else:
            search = start if agrees else prev_end
            n = next(n for n in range(len(text), 0, -1) if whole.find(text[-n:], search) >= 0)
            at = whole.find(text[-n:], search)
            if not agrees:
                start = at
            end = at + n
        spans.append((start, end))
        prev_end = end
    return spans


class Reference:
    def __init__(self, family, kwargs):
        self.f = FAMILIES[family]
        self.kwargs = dict(self.f.get("kwargs", {}), **kwargs)
        self.tok = RefBpe(self.f["added"], self.f["split"], self.f.get("non_special", ()))
        self.env = jinja_reference.make_environment(NOW)
        self.source = TEMPLATES[self.f["template"]]

    def _render(self, messages, tools, gen):
        # transformers' apply_chat_template always passes tools and documents (None when absent).
        ctx = dict(self.kwargs, messages=messages, add_generation_prompt=gen,
                   bos_token=self.f["bos"], eos_token=self.f["eos"], tools=tools, documents=None)
        r = jinja_reference.render(self.env, self.source, ctx)
        if not r["ok"]:
            raise ValueError(r["error"])
        return r

    def example(self, line):
        """(ids, flags, rendered bytes, byte spans, token offsets) of one line."""
        messages, tools = messages_of(line), line.get("tools")
        whole = self._render(messages, tools, False)
        text = whole["text"].encode("utf-8")
        if self.f.get("generation"):
            spans = [tuple(s) for s in whole["spans"]]
        else:
            spans = prefix_spans(
                lambda ms, gen: self._render(ms, tools, gen)["text"].encode("utf-8"),
                messages, text)
        enc = self.tok.encode(whole["text"])
        flags = [int(any(b < se and sb < e for sb, se in spans)) for _, b, e in enc]
        if flags:
            flags[0] |= 2
        return [i for i, _, _ in enc], flags, text, spans, [(b, e) for _, b, e in enc]

    def expected_turns(self, line):
        """Per assistant message, the text its loss should hold (the family's turn)."""
        messages = messages_of(line)
        last_user = max(k for k, m in enumerate(messages) if m["role"] == "user")
        out = []
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                out.append(self.f["turn"](m, last_after_query=k > last_user and k == len(
                    messages) - 1, kwargs=self.kwargs, line=line).encode("utf-8"))
        return out


def write_model_dir(path, family, ref):
    os.makedirs(path, exist_ok=True)
    f = FAMILIES[family]
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as out:
        json.dump(ref.tok.to_json(), out, ensure_ascii=False, indent=1)
    config = {"bos_token": f["bos"], "eos_token": f["eos"],
              "chat_template": TEMPLATES[f["template"]]}
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as out:
        json.dump(config, out, ensure_ascii=False, indent=1)


def read_token_file(path):
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240520, header[0]
    n, width = header[2], {1: 2, 2: 4}[header[1]]
    tokens = list(struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", data[1024:1024 + n * width]))
    assert header[3] == 1, "instruction data carries flags"
    flags = list(data[1024 + n * width:])
    assert len(flags) == n, (len(flags), n)
    return tokens, flags


def flagged_runs(flags):
    """[(first, last + 1)] of the maximal runs of tokens with the loss bit."""
    runs, k = [], 0
    while k < len(flags):
        if flags[k] & 1:
            j = k
            while j < len(flags) and flags[j] & 1:
                j += 1
            runs.append((k, j))
            k = j
        else:
            k += 1
    return runs


# ---------------------------------------------------------------------------------------------


@unittest.skipIf(jinja_reference is None, "jinja2 is not importable")
class ReferenceBpeSelfCheck(unittest.TestCase):
    """The reference tokenizer does what the comparison relies on."""

    def setUp(self):
        self.tok = RefBpe(CHATML_SPECIALS)
        self.split_tok = RefBpe(CHATML_SPECIALS, LLAMA_STYLE_SPLIT)

    def test_newlines_merge_across_a_header_and_a_content(self):
        enc = self.tok.encode("<|im_start|>user\n\nWhat")
        pieces = [self.tok.id_to_piece[i] for i, _, _ in enc]
        self.assertEqual(pieces, ["<|im_start|>", "user", "ĊĊ", "W", "hat"])
        self.assertEqual([(b, e) for _, b, e in enc], [(0, 12), (12, 16), (16, 18), (18, 19),
                                                        (19, 22)])

    def test_three_newlines_take_the_lower_ranked_pair_first(self):
        # "\n\n" outranks "\n\n\n" built from it: four newlines are two "ĊĊ", not "ĊĊĊ" + "Ċ".
        ids = [i for i, _, _ in self.tok.encode("\n\n\n\n")]
        self.assertEqual([self.tok.id_to_piece[i] for i in ids], ["ĊĊ", "ĊĊ"])
        ids = [i for i, _, _ in self.tok.encode("\n\n\n")]
        self.assertEqual([self.tok.id_to_piece[i] for i in ids], ["ĊĊĊ"])

    def test_a_special_token_inside_text_is_split_out_longest_first(self):
        enc = self.tok.encode("It<|im_end|>x<|im_start|>")
        self.assertEqual([self.tok.id_to_piece[i] for i, _, _ in enc],
                         ["It", "<|im_end|>", "x", "<|im_start|>"])
        longer = RefBpe(["<a>", "<a>b"])
        self.assertEqual([longer.id_to_piece[i] for i, _, _ in longer.encode("<a>b<a>")],
                         ["<a>b", "<a>"])

    def test_offsets_are_bytes_and_a_merge_may_hold_parts_of_two_characters(self):
        enc = self.tok.encode("世界")  # E4 B8 96 | E7 95 8C: merges E4 B8 and 96 E7
        self.assertEqual([(b, e) for _, b, e in enc], [(0, 2), (2, 4), (4, 5), (5, 6)])
        for i, b, e in enc:
            self.assertEqual(self.tok.decode([i]), "世界".encode()[b:e])

    def test_the_split_regex_keeps_newline_runs_and_words_apart(self):
        pieces = [self.split_tok.id_to_piece[i] for i, _, _ in
                  self.split_tok.encode("user\n\nIt is 4.\nthe")]
        # As Llama 3's pattern: a digit takes no space before it, punctuation its newlines.
        # "the" without its space has no merge of its own (" the" has).
        self.assertEqual(pieces, ["user", "ĊĊ", "It", "Ġis", "Ġ", "4", ".Ċ", "t", "he"])


@unittest.skipIf(jinja_reference is None, "jinja2 is not importable")
class ChatTokenizeMatchesApplyChatTemplate(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.compared = {}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        for key, (examples, tokens, flagged, straddling) in sorted(cls.compared.items()):
            print(f"  {key}: {examples} examples, {tokens} tokens, {flagged} in loss ("
                  f"{straddling} straddling a turn's edge): equal")

    def run_cli(self, model, jsonl, out, kwargs=None):
        cmd = [CLI, "tokenize", "--tokenizer", model, "--input", jsonl, "--output", out]
        if kwargs is not None:
            cmd += ["--chat-template-kwargs", json.dumps(kwargs)]
        return subprocess.run(cmd, capture_output=True, timeout=60)

    def check_family(self, family, kwargs, label):
        ref = Reference(family, kwargs)
        root = os.path.join(self.tmp.name, label)
        write_model_dir(os.path.join(root, "model"), family, ref)
        lines = conversations(family)
        jsonl = os.path.join(root, "chat.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for name, line in lines:
                # The emoji line as JSON escapes (surrogate pairs), the others as UTF-8.
                f.write(json.dumps(line, ensure_ascii=(name == "non_ascii")) + "\n")
        out = os.path.join(root, "chat.bin")
        cli_kwargs = ref.kwargs if ref.kwargs else None
        r = self.run_cli(os.path.join(root, "model"), jsonl, out, cli_kwargs)
        self.assertEqual(r.returncode, 0, r.stderr.decode(errors="replace"))
        tokens, flags = read_token_file(out)
        at, n_flagged, n_straddling = 0, 0, 0
        for name, line in lines:
            ids, want_flags, text, spans, offsets = ref.example(line)
            with self.subTest(family=label, line=name):
                got_ids, got_flags = tokens[at:at + len(ids)], flags[at:at + len(ids)]
                self.assertEqual(got_ids, ids, self.diff(ref, got_ids, ids))
                self.assertEqual(got_flags, want_flags, self.flag_diff(ref, ids, got_flags,
                                                                       want_flags, text))
                self.check_turns(ref, line, ids, want_flags, text, spans, offsets)
            at += len(ids)
            n_flagged += sum(f & 1 for f in want_flags)
            n_straddling += sum(1 for (b, e), f in zip(offsets, want_flags) if f & 1 and not any(
                sb <= b and e <= se for sb, se in spans))
        self.assertEqual(at, len(tokens), "the file holds more tokens than the examples")
        self.compared[label] = (len(lines), len(tokens), n_flagged, n_straddling)

    def check_turns(self, ref, line, ids, flags, text, spans, offsets):
        """The loss holds, per assistant message, the family's turn text: the spans exactly; the
        flagged tokens decode to the span plus only what a token straddling its start brings from
        the prompt (a "\\n" of the role header merged with the content's first "\\n")."""
        want = ref.expected_turns(line)
        got = [text[b:e] for b, e in spans]
        self.assertEqual(got, want, "the loss spans are not the assistant turns")
        runs = flagged_runs(flags)
        self.assertEqual(len(runs), len(spans))
        for (first, last), (sb, se), turn in zip(runs, spans, want):
            decoded = ref.tok.decode(ids[first:last])
            tb, te = offsets[first][0], offsets[last - 1][1]
            self.assertEqual(decoded, text[tb:te])
            self.assertEqual(te, se, "a turn's last flagged token ends the turn")
            self.assertEqual(decoded, text[tb:sb] + turn)
            self.assertTrue(tb == sb or offsets[first][1] > sb, "only a straddling token")
            self.assertTrue(text[tb:sb].isspace() or tb == sb, text[tb:sb])

    def diff(self, ref, got, want):
        k = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                 min(len(got), len(want)))
        piece = lambda ids: [ref.tok.id_to_piece.get(i, i) for i in ids[max(0, k - 4):k + 4]]
        return f"first difference at token {k}: strata {piece(got)} reference {piece(want)}"

    def flag_diff(self, ref, ids, got, want, text):
        rows = [(k, ref.tok.id_to_piece[ids[k]], got[k], want[k]) for k in range(len(ids))
                if got[k] != want[k]]
        return f"flags differ (token, piece, strata, reference): {rows[:12]} in {text!r}"

    def test_llama3(self):
        self.check_family("llama3", {}, "llama3")

    def test_llama31_with_tools_and_a_tool_call(self):
        self.check_family("llama3.1", {}, "llama3.1")

    def test_qwen25_with_tools_and_a_tool_call(self):
        self.check_family("qwen2.5", {}, "qwen2.5")

    def test_qwen3_thinking_by_default(self):
        self.check_family("qwen3", {}, "qwen3")

    def test_qwen3_thinking_on(self):
        self.check_family("qwen3", {"enable_thinking": True}, "qwen3-thinking-on")

    def test_qwen3_thinking_off(self):
        self.check_family("qwen3", {"enable_thinking": False}, "qwen3-thinking-off")

    def test_gemma3(self):
        self.check_family("gemma3", {}, "gemma3")

    def test_mistral_v01(self):
        self.check_family("mistral-v0.1", {}, "mistral-v0.1")

    def test_mistral_v3(self):
        self.check_family("mistral-v3", {}, "mistral-v3")

    # Mistral v3's template writes the system message into the user message only when that user
    # message is the conversation's last, so the prompt of messages [0, k) is not a prefix of the
    # turn; the turn starts at its own content (instruction_data.h), and the flagged text is the
    # assistant's alone: for {system, "What is 2+2?", "It is 4."} " It is 4.</s>" (the space in the
    # loss through the straddling token " It"), not "What is 2+2?[/INST] It is 4.</s>".
    def test_mistral_v3_system_message_turns_hold_only_the_assistant(self):
        ref = Reference("mistral-v3", {})
        for name, line in conversations("mistral-v3"):
            if _has_system(line):
                with self.subTest(line=name):
                    self.check_turns(ref, line, *ref.example(line))

    def test_phi4(self):
        self.check_family("phi4", {}, "phi4")

    def test_deepseek_v3(self):
        self.check_family("deepseek-v3", {}, "deepseek-v3")

    def test_chatml_with_generation_blocks(self):
        self.check_family("chatml-generation", {}, "chatml-generation")

    def test_mistral_roles_that_do_not_alternate_fail_naming_the_line_and_write_nothing(self):
        for family in ("mistral-v0.1", "mistral-v3"):
            with self.subTest(family=family):
                ref = Reference(family, {})
                root = os.path.join(self.tmp.name, "bad-" + family)
                write_model_dir(os.path.join(root, "model"), family, ref)
                jsonl = os.path.join(root, "bad.jsonl")
                good = {"messages": [_m("user", "a"), _m("assistant", "b")]}
                bad = {"messages": [_m("user", "a"), _m("user", "b"), _m("assistant", "c")]}
                with open(jsonl, "w", encoding="utf-8") as f:
                    f.write(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
                out = os.path.join(root, "bad.bin")
                r = self.run_cli(os.path.join(root, "model"), jsonl, out)
                err = r.stderr.decode(errors="replace").strip()
                self.assertNotEqual(r.returncode, 0)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(f"'{jsonl}' line 3", err)
                self.assertIn("alternate", err)
                self.assertFalse(os.path.exists(out), "no output on failure")


if __name__ == "__main__":
    if jinja_reference is None:
        print(f"SKIP: jinja2 is not importable ({_IMPORT_ERROR})")
        sys.exit(SKIP)
    if not CLI or not os.path.exists(CLI):
        print("SKIP: STRATA_CLI does not name the strata binary")
        sys.exit(SKIP)
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() else 1)
