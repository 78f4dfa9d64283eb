"""Text for the tokenizer and detokenizer tests: English, code, CJK, emoji, combining marks,
whitespace runs, digits, and text holding the model's special tokens (well over 200 strings)."""

from __future__ import annotations

import itertools

ENGLISH = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "I'm sure they'll say we've done what we'd planned, isn't it?",
    "A sentence with UPPER and lower CaSe, plus punctuation!?;:",
    "Numbers: 1, 22, 333, 4444, 55555, 3.14159, -42, 1e-5, 0x1F",
    "In 2024, 365 days passed; 12 months, 52 weeks.",
    "Dr. Smith's e-mail is smith@example.com (call +1-555-0100).",
    "\"Quoted\" and 'single-quoted' text — with an em dash… and ellipsis",
    "Tabs\tand\nnewlines\r\nand carriage returns",
    "https://example.org/path?query=1&x=%20y#frag",
    "It's 5 o'clock somewhere.",
    "   leading spaces",
    "trailing spaces   ",
    "",
    " ",
    "a",
    "Once upon a time, in a land far, far away, there lived a very small model.",
]

CODE = [
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\narr = np.zeros((3, 4), dtype=np.float32)",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "const greet = (name) => `Hello, ${name}!`;",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "fn main() {\n\tlet v: Vec<u8> = vec![1, 2, 3];\n}",
    "<div class=\"box\"><p>Text &amp; more</p></div>",
    "{\"key\": [1, 2, {\"nested\": null}], \"flag\": true}",
    "    if x != None and y == 0:\n        pass\n\n\n",
    "$ ls -la | grep '.py' > out.txt 2>&1",
    "x=1;y=2;z=x+y*3//4%5",
]

CJK = [
    "日本語のテキストです。",
    "東京は日本の首都です",
    "中文文本测试，包括标点符号。",
    "한국어 문장입니다.",
    "漢字とひらがなとカタカナ",
    "混合 English 和中文",
    "ｆｕｌｌｗｉｄｔｈ　ｓｐａｃｅ",
]

EMOJI = [
    "👋 hello",
    "👋🏽 waving with a skin tone",
    "👨‍👩‍👧‍👦 family (ZWJ sequence)",
    "🇫🇷🇯🇵 flags",
    "🙂🙃😀😂🤣",
    "❤️ with a variation selector",
    "emoji at the end 🎉",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters and 𐍈 gothic",
]

COMBINING = [
    "e\u0301 (e + combining acute)",
    "é (precomposed)",
    "n\u0303 o\u0308 a\u030a",
    "Z\u0351\u0352\u0353a\u0354\u0355l\u0356g\u0357o",
    "क्षत्रिय हिन्दी",
    "العربية مع تشكيل: مَرْحَبًا",
    "עברית",
    "Ελληνικά και русский текст",
]

WHITESPACE = [
    "a  b   c    d",
    "\n\n\n",
    "\t\t\t",
    "  \n  \n",
    "word\u00a0nbsp",
    "line1\n\nline3",
    "x" + " " * 17 + "y",
    "\u3000ideographic space",
]

SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text before <|endoftext|> text after",
    "<|im_end|><|im_end|>",
    "no space<|im_start|>glued",
    "<|im_start|> spaced <|im_end|>",
]

BASE = ENGLISH + CODE + CJK + EMOJI + COMBINING + WHITESPACE + SPECIAL


def corpus() -> list[str]:
    """The base strings, then pairs of them joined in three ways (more boundaries between
    kinds of text): over 200 strings, deterministic."""
    out = list(BASE)
    kinds = [ENGLISH, CODE, CJK, EMOJI, COMBINING, WHITESPACE, SPECIAL]
    for a, b in itertools.combinations(range(len(kinds)), 2):
        for i, (x, y) in enumerate(zip(kinds[a], kinds[b], strict=False)):
            out.append((x + y, x + " " + y, x + "\n" + y)[i % 3])
    return out
