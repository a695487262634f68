r"""``tiktoken`` as the encoder of a byte-level BPE ``tokenizer.json``, where it gives the same ids.

``tiktoken`` (OpenAI's BPE library) encodes byte-level BPE several times faster than
``tokenizers``, but it merges differently: at each step the adjacent pair whose
*concatenation* has the lowest rank, and a piece that is a token whole is that token, where
``tokenizers`` applies the file's merge rules in order. The two agree when the ranks (the token
ids) follow the merges' order and no token is reachable by a pair that is not its merge rule:
usually, not provably. So ``tiktoken_encoding(spec, tok)`` builds a ``tiktoken.Encoding`` only for
a file that passes a structural check (``ineligible``: a BPE model without dropout or affixes,
no normalizer, the ByteLevel pre-tokenizer with its regex or a ``Split`` regex before a ByteLevel
without one, every byte a token, each merge's token id above its parts' and above the earlier
merges', every multi-byte token made by a merge, added tokens matched as written and none a prefix
of another), every token of the vocabulary is what the merges make of its own bytes, AND it
encodes ``PROBE`` plus the text of every token of the vocabulary exactly as the ``tokenizers``
tokenizer does. Otherwise it returns None and the reason, which
``experiments.tokenizer`` logs in one line before using ``tokenizers``.

The ``Encoding``'s ids are the file's ids: ``mergeable_ranks`` maps each vocabulary token's bytes
(the ByteLevel alphabet read back to bytes) to its id, and every added token is a special token
matched wherever it occurs in the text, as ``tokenizers`` matches added tokens.
"""

from __future__ import annotations

from typing import Optional

import tiktoken
import tokenizers
from tokenizers import pre_tokenizers

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=True): GPT-2's
BYTE_LEVEL_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

# a varied text both engines must encode alike: code, prose, digits, whitespace runs, tabs,
# contractions, accents, combining marks, CJK, emoji, control characters
PROBE = ("def f(x, y=3):\n\treturn x ** 2 + y  # square\n\n\nclass A_b(B):\n    pass\r\n"
         "It's 10:45 -- they'll've said \"don't\"; I'M HERE, we'RE 'quoted' ok?!\n"
         "  leading   runs    of  spaces \t\t tabs\n \n\n   \n" +
         "1234567890 3.14159 -42 1e-9 0x1F\n"
         "café naïve résumé Ünïcödé e\u0301 \u00a0nbsp \u2003em\u200bzw ñ\n"
         "日本語のテキスト 中文文本 한국어 текст по-русски ελληνικά عربى עברית हिन्दी\n"
         "emoji 👍🏽 🇫🇷 👨‍👩‍👧 ∑∫√∞ ≤≥ ← → ™ © ½ \x00\x07\x1b[0m\x7f\n"
         "https://example.com/a?b=c&d=e#f <html><p class='x'>hi</p></html> {\"k\": [1, 2]}\n"
         "____ ---- ==== .... ''' \"\"\" ``` ~~~ *** ### @@@ $$$ %%% ^^^ &&& ||| \\\\\n")


def byte_decoder() -> dict[str, int]:
    """The ByteLevel alphabet's character -> the byte it stands for (GPT-2's table)."""
    printable = [
        *range(ord("!"),
               ord("~") + 1), *range(ord("¡"),
                                     ord("¬") + 1), *range(ord("®"),
                                                           ord("ÿ") + 1)
    ]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    return chars


# byte_decoder's table for str.translate: each character to the Latin-1 character of its byte
_LATIN1 = {ord(c): b for c, b in byte_decoder().items()}


def _pattern(pre: Optional[dict]) -> tuple[Optional[str], str]:
    """(the pre-tokenizer's regex for tiktoken, None and why where it has none tiktoken runs)."""
    if pre is None:
        return None, "no pre-tokenizer (tiktoken needs a ByteLevel one)"
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    last = steps[-1]
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        return None, f"pre-tokenizer {[s.get('type') for s in steps]} is not ByteLevel last " \
            "without add_prefix_space"
    if len(steps) == 1 and last.get("use_regex", True):
        return BYTE_LEVEL_REGEX, ""
    split = steps[0]
    if (len(steps) == 2 and split.get("type") == "Split" and not last.get("use_regex", True)
            and "Regex" in split.get("pattern", {}) and split.get("behavior") == "Isolated"
            and not split.get("invert")):
        return split["pattern"]["Regex"], ""
    return None, f"pre-tokenizer {[s.get('type') for s in steps]} is not ByteLevel alone or an " \
        "isolating Split regex then ByteLevel without one"


def ineligible(spec: dict) -> str:
    """Why ``spec`` (a parsed tokenizer.json) cannot be served by tiktoken (empty: it can, as far
    as its structure tells)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')!r} is not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model has {key}={model[key]!r}"
    if spec.get("normalizer") is not None:
        return f"a normalizer ({spec['normalizer'].get('type')}) changes the text"
    pattern, why = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return why
    vocab, alphabet = model.get("vocab") or {}, byte_decoder()
    if not set(alphabet) <= set(vocab):
        return "not every byte of the ByteLevel alphabet is a token"
    for i, merge in enumerate(model.get("merges") or []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        got = vocab.get(a + b)
        if got is None or got <= max(vocab.get(a, got), vocab.get(b, got)):
            return f"merge {i} ({a!r}, {b!r}) makes no token with an id above its parts'"
        if i and got <= last:
            return f"merge {i} ({a!r}, {b!r}) has id {got}, not above the earlier merge's {last}"
        last = got
    added = [a["content"] for a in spec.get("added_tokens") or []]
    merged = {"".join(m.split(" ", 1) if isinstance(m, str) else m) for m in model.get("merges")}
    made = [t for t in vocab if len(t) > 1 and t not in merged and t not in added]
    if made:
        return f"{len(made)} multi-byte tokens (e.g. {made[0]!r}) no merge makes"
    for a in spec.get("added_tokens") or []:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            return f"added token {a['content']!r} strips or matches single words"
    if any(x != y and y.startswith(x) for x in added for y in added):
        return "an added token is a prefix of another"
    return ""


def token_bytes(token: str) -> bytes:
    """The bytes a ByteLevel token stands for (its characters are ``byte_decoder``'s)."""
    return token.translate(_LATIN1).encode("latin-1")


def _encoding(spec: dict, name: str) -> tiktoken.Encoding:
    added = {a["content"]: a["id"] for a in spec.get("added_tokens") or []}
    added_ids = set(added.values())
    ranks = {token_bytes(t): i for t, i in spec["model"]["vocab"].items() if i not in added_ids}
    pattern, _ = _pattern(spec.get("pre_tokenizer"))
    return tiktoken.Encoding(f"moe_praxis:{name}",
                             pat_str=pattern,
                             mergeable_ranks=ranks,
                             special_tokens=added)


def encode(enc: tiktoken.Encoding, text: str):
    """``text``'s ids (uint32), every added token matched in it as ``tokenizers`` matches them."""
    return enc.encode_to_numpy(text, allowed_special="all", disallowed_special=())


def differences(enc: tiktoken.Encoding, tok: tokenizers.Tokenizer, texts) -> list[int]:
    """The indices of ``texts`` the two engines encode differently (a text without the first
    character of any added token encoded without looking for them: a tenth of the time on the
    short texts of a vocabulary)."""
    ref = tok.encode_batch_fast(list(texts), add_special_tokens=False)
    firsts = {t[0] for t in enc.special_tokens_set if t}
    ids = lambda t: enc.encode_ordinary(t) if firsts.isdisjoint(t) else encode(enc, t).tolist()
    return [i for i, (t, r) in enumerate(zip(texts, ref)) if ids(t) != r.ids]


def tiktoken_encoding(spec: dict, tok: tokenizers.Tokenizer,
                      name: str) -> tuple[Optional[tiktoken.Encoding], str]:
    """(the ``tiktoken.Encoding`` that encodes as ``tok`` does, "") or (None, why not)."""
    why = ineligible(spec)
    if why:
        return None, why
    try:
        enc = _encoding(spec, name)
    except (ValueError, KeyError, TypeError) as e:  # e.g. a regex tiktoken does not compile
        return None, f"tiktoken does not build it ({' '.join(str(e).split())[:120]})"
    vocab, added = spec["model"]["vocab"], {a["content"] for a in spec.get("added_tokens") or []}
    # tiktoken takes a piece that is a token whole; tokenizers (ignore_merges off) merges it
    split = [
        t for t, i in vocab.items()
        if len(t) > 1 and t not in added and [x.id for x in tok.model.tokenize(t)] != [i]
    ]
    if split:
        return None, f"{len(split)} of the vocabulary's tokens, encoded alone by the merges, " \
            f"are not themselves (e.g. {split[0]!r})"
    words = [token_bytes(t).decode("utf-8", errors="ignore") for t in vocab]
    if differences(enc, tok, [PROBE, *(a["content"] for a in spec.get("added_tokens") or [])]):
        return None, "the probe text encodes differently"
    bad = differences(enc, tok, [w for w in words if w])
    if bad:
        return None, f"{len(bad)} of the vocabulary's tokens, encoded alone, encode differently"
    return enc, ""
