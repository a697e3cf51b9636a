"""The vocabulary conventions llama.cpp keys on ``tokenizer.ggml.pre`` (llama-vocab.cpp),
as data: each pre-tokenizer family's split regexes and options, the ``pre`` names that
select a family, and the token texts that end a turn."""
from __future__ import annotations

from typing import Any


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_RE = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# written with escapes: some of these code points have canonical equivalents
# that editors like to normalize (which would change the ranges)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_DEEPSEEK3 = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_PORO_RE = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# family -> split regexes, applied one after the other (each splits every piece
# the previous left, keeping matches and the text between them), and options.
PRE_FAMILIES: dict[str, dict[str, Any]] = {
    "default": {"regex": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"]},
    "llama3": {"regex": [_LLAMA3_RE], "ignore_merges": True, "add_bos": True},
    "dbrx": {"regex": [_LLAMA3_RE]},
    "chatglm4": {"regex": [_LLAMA3_RE]},
    "glm4": {"regex": [_LLAMA3_RE], "ignore_merges": True},
    "deepseek-llm": {"regex": ["[\r\n]", "\\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
                               "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_DEEPSEEK, r"\p{N}+"]},
    "deepseek-coder": {"regex": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, r"\p{N}"]},
    "deepseek-v3": {"regex": [r"\p{N}{1,3}", _CJK_DEEPSEEK3, _DEEPSEEK3_RE]},
    "falcon": {"regex": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"]},
    "starcoder": {"regex": [r"\p{N}", _GPT2_RE]},
    "gpt2": {"regex": [_GPT2_RE]},
    "qwen2": {"regex": [_QWEN2_RE]},
    "qwen35": {"regex": [_QWEN35_RE]},
    "poro": {"regex": [_PORO_RE]},
    "viking": {"regex": [_PORO_RE, r"\p{N}"]},
    "tekken": {"regex": [_TEKKEN_RE], "ignore_merges": True, "add_bos": True},
    "gpt4o": {"regex": [_GPT4O_RE]},
    "minicpm5": {"regex": [r"\p{N}{1,3}", _TEKKEN_RE], "ignore_merges": True},
    "seed-coder": {"regex": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                             r"|\s*[\r\n]+|\s+(?!\S)|\s+"]},
    "bailingmoe": {"regex": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"]},
    "kimi-k2": {"regex": [r"\p{Han}+"]},
    "chameleon": {"regex": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                            r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2_RE],
                  "add_bos": True},
    "whitespace": {"regex": [r"\S+"], "byte_encode": False},
}

# tokenizer.ggml.pre value -> family
PRE_ALIASES: dict[str, str] = {
    "default": "default",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3",
    "jina-v5-nano": "llama3",
    "dbrx": "dbrx", "smaug-bpe": "dbrx",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    "deepseek-v3": "deepseek-v3", "hunyuan-dense": "deepseek-v3", "joyai-llm": "deepseek-v3",
    "hy_v4": "deepseek-v3",
    "falcon": "falcon",
    "starcoder": "starcoder", "refact": "starcoder", "command-r": "starcoder", "smollm": "starcoder",
    "codeshell": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder", "mellum2": "starcoder",
    "gpt-2": "gpt2", "phi-2": "gpt2", "jina-es": "gpt2", "jina-de": "gpt2", "gigachat": "gpt2",
    "jina-v2-es": "gpt2", "jina-v2-de": "gpt2", "a.x-4.0": "gpt2", "mellum": "gpt2",
    "modern-bert": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "trillion": "gpt2",
    "granite-docling": "gpt2", "exaone4": "gpt2", "jina-v1-en": "gpt2", "jina-v2-code": "gpt2",
    "roberta-bpe": "gpt2",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2",
    "stablelm2": "qwen2", "hunyuan": "qwen2", "solar-open": "qwen2", "megrez": "qwen2",
    "grok-2": "qwen2",
    "qwen35": "qwen35",
    "poro-chat": "poro", "bloom": "poro", "gpt3-finnish": "poro",
    "viking": "viking",
    "chatglm-bpe": "chatglm4", "glm4": "glm4", "glm5": "glm4",
    "tekken": "tekken",
    "gpt-4o": "gpt4o", "llama4": "gpt4o", "kanana2": "gpt4o", "talkie": "gpt4o", "minimax-m2": "gpt4o",
    "minicpm5": "minicpm5",
    "seed-coder": "seed-coder",
    "bailingmoe": "bailingmoe", "bailingmoe2": "bailingmoe", "llada-moe": "bailingmoe",
    "kimi-k2": "kimi-k2",
    "chameleon": "chameleon",
    "whitespace": "whitespace",
}

# token texts that end a turn (besides eos), as llama.cpp's end-of-generation list
EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[", "<|END_OF_TURN_TOKEN|>",
})
