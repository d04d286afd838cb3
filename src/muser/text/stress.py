"""Stress inputs for tokenizer parity: scripts, emoji, combining marks, whitespace and digit
runs, control characters, contractions, special-token text, malformed UTF-8. Deterministic.

`stress_texts()` are valid text (the str API); `stress_bytes()` are raw byte strings, most of them
malformed UTF-8 (the bytes API). Inputs that make the pinned llama.cpp throw (a sequence decoding
above U+10FFFF) are not here: Muser refuses those, see `OVER_MAX_BYTES`.
"""

from __future__ import annotations

import random

from ..errors import TokenizerError
from .unicode import decode_utf8_lenient

# Decodes to U+110000 in llama.cpp's lenient decoder, which then throws while re-encoding it.
OVER_MAX_BYTES = (b"\xf4\x90\x80\x80", b"ab\xf7\xbf\xbf\xbfcd")

SCRIPTS = [
    "Ünïcödé façade naïve coöperate Ærøskøbing ÀÉÎÕÜ àéîõü ÀÉèé ÉTÉ été",
    "Ελληνικά: Η γρήγορη καφέ αλεπού ΠΗΔΑΕΙ ΠΑΝΩ από τον τεμπέλη σκύλο",
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю. МОСКВА",
    "العربية: نص عربي للاختبار مع أرقام ٠١٢٣٤٥٦٧٨٩ وعلامات ترقيم؟",
    "עברית: טקסט בעברית לבדיקה, עם ניקוד: שָׁלוֹם",
    "हिन्दी: यह एक परीक्षण वाक्य है। संख्या १२३४५",
    "ไทย: ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ ๑๒๓",
    "中文：这是一个测试句子，包含标点符号。漢字と日本語のテキスト、カタカナとひらがな。",
    "한국어: 다람쥐 헌 쳇바퀴에 타고파. 숫자 12345",
    "Tiếng Việt: Tôi có thể ăn thủy tinh mà không hại gì.",
    "ქართული ენა, Հայերեն լեզու, ᚠᛇᚻ᛫ᛒᛦᚦ, 𐌰𐌱𐌲 (Gothic), 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙",
    "Unicode 15.1: \u0cf3 \u0ece \u2ffc\u2fff \u31ef \U00011f04\U00011f10 \U00011f50\U00011f59 "
    "\U0001e4d0\U0001e4eb\U0001e4f0 \U0001fa75 \U0002ebf0\U0002ee5d \U00031350",
    "Letter-like and numbers: ⅠⅡⅢ ⅰⅱ ½¾ ²³ ①②③ ℃ ℕ ﬁ ﬂ Ǆǅǆ ǈ ᾈ ꙮ",
]

EMOJI = [
    "emoji 😀😃😄 👍🏽👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵🇩🇪 ❤️ ✔️ 🧑🏻‍💻 ⌚️ 🫠🫡",
    "keycaps 1️⃣ #️⃣ *️⃣ and tags 🏴󠁧󠁢󠁳󠁣󠁴󠁿 mixed:abc😀def😀😀ghi",
]

COMBINING = [
    "e\u0301 e\u0301\u0301\u0301 a\u0308\u0304 Z\u0335\u0321\u0322\u0327\u0328\u0336a\u0337\u0334lgo",
    "n\u0303o\u0302\u0323 \u0301leading mark, mark after space \u0300\u0301\u0302 and digit 5\u20e3",
    "Ḩ̵̢̛̗͈̙͇̬̜̪̟̘̦̗̲̪̓̃̆̈́̋͗̊̓͐͒̆̏͘e̸̡̳̦̼̠̘͎̙͔̫͙̯̾̈́͋̇̊͆̈́̽̐̂̑̚͜͝ ĉ̵̨̧̛̰̪̖̠̦͓͍̙̰͇͖̦̳̃͊̏̄̍͋̇̈́̐̈́o̷̡̮̳̝̖̻̗̖̼̙͉̫̣̊̌̓̇̇̋̓̔͊m̸̛̪͍͙̘̮̳̦͂̎͛̇̀́̒͘͘e̶̬̩͎̩̰̠̩̻̤̿̈́s",
]

WHITESPACE = [
    " " * 1, " " * 2, " " * 3, "a" + " " * 17 + "b", "\t\t\tx", "\n" * 9 + "y", "\r\n\r\n\r\nz",
    "  \n  \n\t \n", " \u00a0 \u3000 \u2003x\u2028y\u2029z\u0085w", "x" + " " * 2000,
    "trailing   ", "   leading", "\v\f\x1c\x1d\x1e\x1f mixed controls",
    "\x00\x01\x02 nul and friends \x7f\x80\x9f", " \n \n \n", "\t" * 500 + "end",
    "word \n\n\n  word", "a\u200bb\u200cc\u200dd\ufeffe",
]

DIGITS = [
    "1", "12", "123", "1234", "12345", "1" * 301, "3.14159265358979323846264338327950288419716939937510",
    "0x1F 0b1010 1e-5 1_000_000 -42 +7", "٠١٢٣٤٥٦٧٨٩ ۰۱۲ ０１２３４５ 𝟎𝟏𝟐 ①②",
    "2024-01-02T03:04:05Z 192.168.0.1 v1.2.3", "9" * 5000,
]

CONTRACTIONS = [
    "I'm you're he's she'd we'll they've it'd don't can't won't",
    "I'M YOU'RE HE'S SHE'D WE'LL THEY'VE 'S 'T 'RE 'VE 'M 'LL 'D",
    "Mixed 'Ll 'lL 'Re 'vE x'sy 'ss ''s ' s 'x", "l'amour d'été aujourd'hui ’curly’ quotes",
]

CODE = [
    "def f(x):\n    return x ** 2  # square\n\nclass A(B, metaclass=M):\n\tpass\n",
    "if (a<=b && c!=d) { x += y >> 2; } // comment\n/* block */ std::vector<int> v{1,2,3};",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "path/to/file.py:123: error: 'NoneType' object has no attribute '__dict__'",
    "λx.λy.x y → ∀ε>0 ∃δ>0: |x−a|<δ ⇒ |f(x)−f(a)|<ε",
    "```python\nprint('hi')\n```\n- item\n* item\n> quote",
]


def special_texts(specials: list[str]) -> list[str]:
    """Texts that contain, nest, split and abut special-token text."""
    out = []
    for s in specials[:12]:
        out += [s, f"before{s}after", f" {s} ", f"{s}{s}", s[:-1], s[1:], f"<{s}>", f"{s[:3]} {s[3:]}",
                f"\n{s}\n", f"x{s[:len(s)//2]}{s}{s[len(s)//2:]}y"]
    if len(specials) >= 2:
        out.append("".join(specials[:6]))
        out.append(f"{specials[0]}Hello{specials[1]} world{specials[0]}")
    return out


def random_unicode(rng: random.Random, n: int) -> str:
    """Codepoints from every plane and category (no surrogates), spaced with ASCII."""
    pools = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
             (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
             (0x2070, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
             (0xE000, 0xF8FF), (0xFB00, 0xFFFD), (0x10000, 0x1FFFF), (0x20000, 0x323AF),
             (0xE0000, 0xE01EF), (0xF0000, 0x10FFFD)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.15:
            out.append(rng.choice([" ", "  ", "\n", "'s", "1", "A", "a"]))
    return "".join(out)


def stress_texts(specials: list[str] = (), seed: int = 0, n_random: int = 200) -> list[str]:
    rng = random.Random(seed)
    texts = SCRIPTS + EMOJI + COMBINING + WHITESPACE + DIGITS + CONTRACTIONS + CODE
    texts += special_texts(list(specials))
    texts += [random_unicode(rng, rng.randint(1, 300)) for _ in range(n_random)]
    # every codepoint class boundary in one long text: each BMP block start and end
    texts.append("".join(chr(c) for c in range(0x20, 0x3000, 7) if not 0xD800 <= c <= 0xDFFF))
    texts.append("".join(chr(c) for c in range(0x10000, 0x32000, 97)))
    return texts


def stress_bytes(seed: int = 0, n_random: int = 100) -> list[bytes]:
    rng = random.Random(seed)
    cases = [
        b"\xff", b"\xfe\xff", b"abc\x80def", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(",
        b"\xf0\x9f\x98", b"\xf0\x9f\x98 x", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80",
        b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"\xf8\x88\x80\x80\x80", b"\xfc\x84\x80\x80\x80\x80",
        b"\x80\x80\x80", b"caf\xe9 na\xefve", b"\xef\xbb\xbfBOM", "valid ünïcödé".encode() + b"\x80",
        b"<|eot|>\xc3", b"\xc3<|eot|>", b"\xe2\x96\x81x", b"\xe2\x96", b"  \xa0 \x85 ",
    ]
    for _ in range(n_random):
        n = rng.randint(1, 40)
        cases.append(bytes(rng.randint(0, 255) for _ in range(n)))
        good = random_unicode(rng, rng.randint(1, 20)).encode("utf-8")
        cut = rng.randint(0, len(good))
        cases.append(good[:cut] + bytes([rng.randint(0x80, 0xFF)]) + good[cut:])
    # llama.cpp throws on sequences decoding above U+10FFFF: keep those out of the parity set
    kept = []
    for c in cases:
        try:
            decode_utf8_lenient(c)
        except TokenizerError:
            continue
        kept.append(c)
    return kept
