"""The vocabulary of the generated test models (``gguf/testing.py``, ``gguf/testing_swa.py``):
SentencePiece-style pieces built from English words, sub-words and syllables, the special
tokens' ids, and the tokenizer's GGUF keys."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFWriter

__all__ = [
    "BOS_ID",
    "BYTE_TOKEN_OFFSET",
    "EOS_ID",
    "IM_END_ID",
    "IM_START_ID",
    "N_SPECIAL_TOKENS",
    "UNK_ID",
    "add_test_vocab",
    "build_vocab",
]

#: Token ids of the special tokens (identical for every generated model).
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
#: ``<0xNN>`` has id ``BYTE_TOKEN_OFFSET + NN``.
BYTE_TOKEN_OFFSET = 3
IM_START_ID = BYTE_TOKEN_OFFSET + 256
IM_END_ID = IM_START_ID + 1
#: Ids below this are special or byte tokens; normal pieces start here.
N_SPECIAL_TOKENS = IM_END_ID + 1
_SPACE = "\u2581"  # "▁", SentencePiece's word-boundary marker

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

# Common English words, most frequent first, with the vocabulary of programming documentation
# mixed in (the sentences of english_sentences() come from docstrings). Hard-coded, so the
# vocabulary is the same everywhere.
_WORDS = """
the of and to a in is that for it as with be on by this are not or from at an which have
you if was can but all will one has its they more when there their been would other than
also only some into any such these so may new used return returns value values object objects
function functions file files string strings list lists set name names default none true false
type types data time first two use each should must then what about how out up no do does
where we our he she his her them who same make called call calls given number numbers error
errors after before between over under while through because both most many much very well
even back just like get gets see way made where those same last long little own other here
module modules class classes method methods instance argument arguments parameter parameters
attribute attributes key keys item items element elements index line lines text character
characters byte bytes buffer stream input output read write open close path directory system
process thread threads lock queue task tasks event events loop server client request response
message messages header headers body socket connection address port host protocol format
version option options flag flags mode size length count result results state current next
previous start end begin stop run running wait timeout signal exception raise raised raises
case cases example examples note information description documentation support supported
using based following called without within against during around until since upon whether
however therefore otherwise instead already always never often usually sometimes still again
all any every few several another either neither each both least less more most enough
number integer float decimal fraction complex boolean sequence tuple dictionary mapping
iterator generator iterable callable context manager handler pattern match expression
statement block scope variable constant global local public private internal external
empty full single multiple optional required specific general special simple different
similar possible available valid invalid unknown known given specified current original
first second third last final initial new old high low large small long short big great
good best better right left top bottom true false real main common important same own
able able part parts place point points level levels order group groups source target
create created creates delete deleted remove removed add added adds change changed changes
check checks checked test tests tested find found search replace copy move keep let put
take took show shows shown give gives gave look looks think know knew want need needs
work works worked try tries tried come came go goes went say says said tell told ask asked
feel seem become became leave left bring began begin turn turns help helps mean means
include includes included contain contains contained provide provides provided allow
allows allowed require requires required return returned define defined describe described
convert converted compute computed represent represents handle handled apply applied
store stored load loaded save saved send sent receive received accept accepted reject
parse parsed build built generate generated produce produced update updated select selected
people person man men woman women child children world life day days year years week
month hour hours minute minutes second seconds moment today tomorrow yesterday morning
evening night home house room door window city country state government company group
family friend friends school student students teacher book books story word words letter
letters page pages question questions answer answers problem problems idea ideas reason
fact facts area areas way ways thing things kind kinds side sides head hand hands eye eyes
face water food money power force energy light sound music game games art history science
nature body mind heart voice name market business service services program programs
computer software hardware network internet machine memory disk storage database table
column row rows field fields record records entry entries user users account password
security permission permissions access control value memory cache size limit limits range
ranges step steps stage phase cycle pass passes call call copy copies view views window
"""

# Frequent English sub-word pieces (suffixes, prefixes, inner syllables), most useful first.
_SUBWORDS = """
s ed ing er es ly ion tion ation ions al ent ers re in on at en an or ar le st th he nd
ng ou it is ic ity ive ment ments ness able ible ful less ous est ist ism ize ized ization
un dis pre pro con com ex sub inter trans over under out up de en im ir il non mis
ter ter ated ates ating ance ence ant ary ory age ure ial ical ually ally ine ite ide
ade ake ame ane ape are ase ate ave ere ice ike ime ine ire ise one ore ose ote ove ume
ack ick ock uck ell ill oll ull ash ish ush ang ing ong ung ank ink onk unk ark ork urn
"""

_LOWER = "abcdefghijklmnopqrstuvwxyz"
_UPPER = _LOWER.upper()
_DIGITS = "0123456789"
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y",
    "z", "ch", "sh", "th", "wh", "bl", "br", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr",
    "sc", "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "tr", "tw", "qu",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "ay", "oa", "y")
_CODAS = (
    "", "b", "ck", "d", "ff", "g", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p", "r", "rd",
    "rt", "s", "ss", "st", "t", "th", "x",
)  # fmt: skip


def _words(text: str) -> list[str]:
    return list(dict.fromkeys(text.split()))


def _ngram_pieces() -> list[str]:
    """Letter n-grams (length 2..4) inside the word list, most frequent first."""
    counts: dict[str, int] = {}
    for word in _words(_WORDS):
        for n in (2, 3, 4):
            for i in range(len(word) - n + 1):
                gram = word[i : i + n]
                counts[gram] = counts.get(gram, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    return [gram for gram, count in ranked if count >= 2]


def _syllables() -> Iterator[str]:
    for onset in _ONSETS:
        for vowel in _VOWELS:
            for coda in _CODAS:
                yield onset + vowel + coda


def _candidate_pieces() -> Iterator[str]:
    """Every normal piece the vocabulary may hold, most useful first (may repeat)."""
    yield _SPACE
    yield from _LOWER
    yield from _UPPER
    yield from _DIGITS
    yield from _PUNCT
    words = _words(_WORDS)
    for word in words:
        yield _SPACE + word
    yield from _words(_SUBWORDS)
    for word in words:
        yield _SPACE + word[0].upper() + word[1:]
    yield from _ngram_pieces()
    for word in words:
        yield word
    for digits in range(100):
        yield _SPACE + str(digits)
    syllables = list(_syllables())
    for syllable in syllables:
        yield _SPACE + syllable
    for syllable in syllables:
        yield syllable
    for syllable in syllables:
        yield _SPACE + syllable[:1].upper() + syllable[1:]
    # Practically unbounded: two-syllable words.
    for first in syllables:
        for second in syllables:
            yield _SPACE + first + second


@lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """The vocabulary of a generated model: ``(pieces, scores, token_types)``, ``n_vocab`` long.

    Normal pieces are prefix-closed (every prefix of a piece is a piece, added before it), so
    llama.cpp's SentencePiece merge can reach every piece; a piece's score grows with its length,
    so longer pieces win merges, and among equal lengths the earlier (more common) one wins.
    """
    from gguf.constants import TokenType

    pieces: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces += ["<|im_start|>", "<|im_end|>"]
    types += [TokenType.CONTROL, TokenType.CONTROL]
    assert len(pieces) == N_SPECIAL_TOKENS

    seen: dict[str, None] = {}
    for candidate in _candidate_pieces():
        if len(pieces) + len(seen) >= n_vocab:
            break
        # Add the missing prefixes first, then the piece itself, while there is room.
        for end in range(1, len(candidate) + 1):
            prefix = candidate[:end]
            if prefix not in seen:
                if len(pieces) + len(seen) >= n_vocab:
                    break
                seen[prefix] = None
    normal = list(seen)
    if len(pieces) + len(normal) < n_vocab:  # pragma: no cover - the generator is huge
        raise ValueError(f"cannot generate {n_vocab} distinct pieces")
    pieces += normal
    types += [TokenType.NORMAL] * len(normal)

    scores = [0.0] * N_SPECIAL_TOKENS
    denom = float(len(normal) + 1)
    scores += [float(len(piece)) - rank / denom for rank, piece in enumerate(normal)]
    return tuple(pieces), tuple(scores), tuple(int(t) for t in types)


def add_test_vocab(writer: GGUFWriter, n_vocab: int) -> None:
    """Write the tokenizer of a generated model: :func:`build_vocab` and the special ids."""
    pieces, scores, types = build_vocab(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(pieces))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_eot_token_id(IM_END_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
