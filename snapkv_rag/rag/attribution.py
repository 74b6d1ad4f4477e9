"""Attributed citations: which stuffed chunks support each sentence of an answer.

Small models answer from short contexts but rarely write usable ``[n]`` markers, so the
toolkit attributes each answer sentence itself by evidence matching. Each chunk's score
for a sentence is the cosine similarity (the RAG embedder) between the chunk and the
question plus the sentence, plus the share of the sentence's content words found in the
chunk. The best chunk is cited when its score clears ``threshold``, together with any
chunk within ``margin`` of it (at most 3).

A sentence's *key facts* (its numbers, times, dates and capitalised names that the question
does not already contain) must appear in a chunk for that chunk to support it: similarity
alone let "The primary school is 100." be "supported" by three documents that never mention
a school or 100. A sentence whose key facts appear in no stuffed chunk is *not supported*;
one with some facts found and others not is cited where the found ones are, and
:attr:`SentenceSupport.missing` lists the others (partly supported). A fact counts only where
a word of the sentence or question stands within 30 tokens of it: a document listing numbers
and names holds every fact but none as evidence. A sentence that
calculates ("7,699 * 10 = 76,990") is checked too: a result the arithmetic gives is not
looked for in the documents, but a wrong result ("7,699 * 10 = 769"), or an operand no chunk
holds, leaves the sentence not supported at all, since its claim is the calculation.

Choice by measurement (eval/rag/RESULTS.md, "Citations on the RAG pipeline"): on 40 questions
over the sample corpus, the uncompressed model's answers attributed with "hybrid",
"embedding" and "lexical" reached gold F1 0.693, 0.709 and 0.711 at their best settings,
too close to call on 40 questions, so the method stays "hybrid". The threshold did not
matter below 0.9 (every answer sentence cleared it); the margin did: hybrid's margin 0.2
raised gold F1 from 0.644 (margin 0.1) to 0.693, better on 6 questions and worse on none,
precision unchanged (0.988), so 0.2 is hybrid's default.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

from .embeddings import Embedder

METHODS = ("hybrid", "embedding", "lexical")
DEFAULT_THRESHOLDS = {"hybrid": 0.6, "embedding": 0.3, "lexical": 0.3}
DEFAULT_MARGINS = {"hybrid": 0.2, "embedding": 0.1, "lexical": 0.2}  # eval/rag/RESULTS.md, "Citations on the RAG pipeline"
DEFAULT_ATTENTION_WEIGHT = 0.25  # the attention route: the least harmful weight measured (eval/rag/RESULTS.md, "Citations from the run's own attention")
_MARKER = re.compile(r"\[\s*\d+(?:\s*[,;]\s*\d+)*\s*\]")
# A sentence ends at . ! or ? (then closing quotes and any [n] markers, which stay with it) before
# whitespace and a capital or a digit, or at a line break; "6:40 a.m. on weekdays" and "3.40" go on.
_SENTENCE_END = re.compile(rf"[.!?]+[\"')\]]*(?:\s*{_MARKER.pattern})*(\s+)(?=[\"'(]?[A-Z0-9])|\n+")
# Words before a period that do not end a sentence: titles ("Dr. Hale", "St. Aldric"), "e.g. Monday"
# and initials ("J. R. Smith", "U.S. Navy"). "a.m." and "etc." often do end one, so they are not here.
_TITLES = frozenset("dr mr mrs ms st mt prof rev jr sr capt col gen lt sgt fr e.g i.e vs cf".split())
_INITIALS = re.compile(r"(?:[A-Z]\.)*[A-Z]")
_LAST_WORD = re.compile(r"([\w.]+)$")
_WORD = re.compile(r"[\w][\w'\-:.]*[\w]|\w")
STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for with from as is are was were be been being it its this that these
    those there here what which who whom whose when where why how do does did done has have had not no yes so than then
    too very can could will would shall should may might must i you he she we they me him her us them my your his our
    their about into over under after before during between also only just more most some any each other such own same
    up down out off again further once all both few many much per via answer question document documents""".split()
)


_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_NAME = re.compile(r"\b[A-Z][A-Za-z'\-]*[A-Za-z]\b")


@dataclass(frozen=True)
class SentenceSupport:
    sentence: str
    numbers: tuple[int, ...]  # 1-based document numbers in the prompt
    scores: tuple[float, ...]  # the score of each cited number
    missing: tuple[str, ...] = ()  # key facts of the sentence that no stuffed chunk contains

    @property
    def supported(self) -> bool:
        return bool(self.numbers)


_TOKEN = re.compile(r"\d+(?:[.,:]\d+)*|[A-Za-z][A-Za-z'\-]*")


_THOUSANDS = re.compile(r",(?=\d{3}\b)")  # "40,000": the comma between thousands


def _normal_number(raw: str) -> str:
    raw = _THOUSANDS.sub("", raw.strip(".,:"))
    return ":".join(part.lstrip("0") or "0" for part in re.split(r"[.:,]", raw))


def _numbers(text: str) -> set[str]:
    """Numbers and times, normalised: "06:40" and "6.40" are "6:40", "40,000" is "40000"."""
    return {_normal_number(raw) for raw in _NUMBER.findall(text)}


def _number_words(text: str, reach: int) -> Iterator[tuple[str, str]]:
    """``(normalised number, word)`` for each word of 3+ letters among the ``reach`` tokens after a number."""
    tokens = _TOKEN.findall(text)
    for i, token in enumerate(tokens):
        if token[0].isdigit():
            number = _normal_number(token)
            yield from ((number, w.lower()) for w in tokens[i + 1 : i + 1 + reach] if w[0].isalpha() and len(w) >= 3)


def _counted(text: str) -> set[str]:
    """Each number with the word right after it when that word says what is counted
    ("12 beds"), so "12 beds" is not supported by a chunk's "12 bakeries". Times have no unit."""
    return {f"{n} {w}" for n, w in _number_words(text, 1) if ":" not in n and w not in STOPWORDS and w not in _NOT_UNITS}


_NOT_UNITS = frozenset({"a.m", "p.m", "am", "pm", "and", "or", "per", "years", "year"})


def key_facts(sentence: str, question: str = "") -> set[str]:
    """The sentence's numbers and capitalised names (not its first word, not stopwords) that
    the question does not contain; names lower-cased."""
    asked_numbers = _numbers(question)
    asked_words = {w.lower() for w in _WORD.findall(question)}
    counted = {c.split(" ")[0]: c for c in _counted(sentence)}
    facts = {counted.get(n, n) for n in _numbers(sentence) if n not in asked_numbers}
    first = _WORD.search(sentence)
    for m in _NAME.finditer(sentence):
        if first is not None and m.start() == first.start():
            continue
        word = m.group(0).lower()
        if word not in STOPWORDS and word not in asked_words and len(word) > 1:
            facts.add(word)
    return facts


@dataclass(frozen=True)
class _ChunkEvidence:
    numbers: frozenset[str]  # normalised numbers, and "N unit" (4 letters) for words up to 3 after each
    words: frozenset[str]  # lower-cased words, with and without trailing '.', ':' or "'"
    stems: frozenset[str]  # first five letters of words of 4+ letters (not stopwords)


@lru_cache(maxsize=4096)
def _evidence(chunk_text: str) -> _ChunkEvidence:
    """What the fact gate looks up in one chunk, computed once per chunk text (every answer
    sentence and every sweep setting asks the same chunks)."""
    words = [w.lower() for w in _WORD.findall(chunk_text)]
    counted = {f"{n} {w[:4]}" for n, w in _number_words(chunk_text, 3)}
    return _ChunkEvidence(
        frozenset(_numbers(chunk_text) | counted),
        frozenset(words) | frozenset(w.strip(".:'") for w in words),
        frozenset(w[:5] for w in words if len(w) >= 4 and w not in STOPWORDS),
    )


def facts_in(facts: set[str], chunk_text: str, context: frozenset[str] = frozenset()) -> set[str]:
    """The ``facts`` that ``chunk_text`` contains; with ``context`` (word stems of the sentence
    and question, see :func:`context_stems`), only those found within :data:`FACT_REACH` tokens
    of one of those stems: a list of numbers and names holds every fact, next to none of the words."""
    if not facts:
        return set()
    evidence = _evidence(chunk_text)
    found = {f for f in facts if _unit_prefix(f) in evidence.numbers or f in evidence.words}
    if not context or not found:
        return found
    return {f for f in found if _near_context(f, chunk_text, context)}


#: Tokens on either side of a fact in a chunk where a word of the sentence or question must be
#: for the chunk to hold that fact as evidence.
FACT_REACH = 30


@lru_cache(maxsize=4096)
def _positions(chunk_text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Per token of ``chunk_text`` (:data:`_TOKEN`): its fact form (a normalised number or a
    lower-cased word) and its stem (first five letters of a 4+ letter non-stopword, else "")."""
    tokens = _TOKEN.findall(chunk_text)
    forms = tuple(_normal_number(t) if t[0].isdigit() else t.lower() for t in tokens)
    stems = tuple(t.lower()[:5] if t[0].isalpha() and len(t) >= 4 and t.lower() not in STOPWORDS else "" for t in tokens)
    return forms, stems


def _near_context(fact: str, chunk_text: str, context: frozenset[str]) -> bool:
    forms, stems = _positions(chunk_text)
    number, _, unit = fact.partition(" ")
    target = number if unit else fact
    for i, form in enumerate(forms):
        if form != target.rstrip(".:'"):
            continue
        if unit and not any(f[:4] == unit[:4] for f in forms[i + 1 : i + 4]):
            continue
        if any(stem in context for stem in stems[max(0, i - FACT_REACH) : i + FACT_REACH + 1]):
            return True
    return False


def context_stems(sentence: str, question: str, facts: set[str]) -> frozenset[str]:
    """The stems a fact's neighbourhood must share with the claim: the sentence's and question's
    words of 4+ letters (not stopwords), less the facts' own."""
    own = {w[:5] for f in facts for w in f.split(" ") if w[:1].isalpha()}
    return frozenset((_stems(sentence) | _stems(question)) - own)


def _unit_prefix(fact: str) -> str:
    """A counted fact as matched: the number and the unit's first four letters ("12 beds" -> "12 beds",
    "40 minutes" -> "40 minu"), so plurals and short forms of the same word match."""
    number, _, unit = fact.partition(" ")
    return f"{number} {unit[:4]}" if unit else fact


def split_sentences(text: str) -> list[str]:
    pieces, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        if end.group(1) is not None and text[end.start()] == ".":
            word = _LAST_WORD.search(text, start, end.start())
            if word and (word.group(1).lower() in _TITLES or _INITIALS.fullmatch(word.group(1))):
                continue
        cut = end.start(1) if end.group(1) is not None else end.start()
        pieces.append(text[start:cut])
        start = end.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if len(p.strip()) > 1]


def content_words(text: str) -> set[str]:
    return {w.lower().strip(".:") for w in _WORD.findall(text) if w.lower() not in STOPWORDS and len(w) > 1}


def lexical_support(sentence: str, chunk_text: str) -> float:
    words = content_words(sentence)
    if not words:
        return 0.0
    return len(words & content_words(chunk_text)) / len(words)


def answer_sentences(answer: str) -> list[str]:
    """The answer's sentences that can be attributed: ``[n]`` markers removed, content words left."""
    return [s for s in (_MARKER.sub("", s).strip() for s in split_sentences(answer)) if content_words(s)]


def _stems(text: str) -> set[str]:
    return {w.lower()[:5] for w in _WORD.findall(text) if len(w) >= 4 and w.lower() not in STOPWORDS}


def absent_subjects(sentence: str, question: str, chunk_texts: Sequence[str]) -> set[str]:
    """Words the sentence takes from the question (4+ letters, not stopwords) that no chunk
    contains, compared by their first five letters: the documents do not talk about them."""
    present = set().union(*(_evidence(t).stems for t in chunk_texts))
    asked = _stems(question)
    return {
        w.lower() for w in _WORD.findall(sentence) if len(w) >= 4 and w.lower()[:5] in asked and w.lower()[:5] not in present and w.lower() not in STOPWORDS
    }


# "7,699 * 10 = 76,990", "12 x 3 = 36", "3.5 + 1.25 = 4.75": numbers and operators, then "=" and the result
# (found as a whole run of numbers and operators, then "=" looked for after it: one pattern with
# both backtracked over every later start of a long run without "=", quadratic in its length)
_EXPRESSION = re.compile(r"(?<![\w.,])\d[\d,.]*((?:\s*[-+*/×x−÷]\s*\d[\d,.]*)*)")
_RESULT = re.compile(r"\s*=\s*(\d[\d,]*(?:\.\d+)?)")
# What the check evaluates: a sentence's arithmetic is short. Anything longer (a 400-digit operand,
# a 3,000-term sum) is not checked at all rather than evaluated: float() of a huge int overflows and
# a parsed expression tree that deep overflows the stack.
MAX_CALCULATION_TERMS = 32
MAX_NUMBER_DIGITS = 30
_ARITHMETIC_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?)|([-+*/]))")


def _arithmetic(expression: str) -> float | None:
    """The value of ``expression`` (numbers joined by + - * /, the usual precedence, left to
    right), or None when it is not such an expression, is too long (more than
    :data:`MAX_CALCULATION_TERMS` numbers, or a number of more than :data:`MAX_NUMBER_DIGITS`
    digits), divides by zero or leaves the finite floats. Iterative: never recurses, never raises."""
    numbers: list[float] = []
    operators: list[str] = []
    position, end = 0, len(expression.rstrip())
    while position < end:
        m = _ARITHMETIC_TOKEN.match(expression, position)
        if m is None:
            return None
        number, op = m.group(1), m.group(2)
        if (number is None) != (len(numbers) > len(operators)):  # numbers and operators must alternate
            return None
        if number is not None:
            if len(number) - number.count(".") > MAX_NUMBER_DIGITS or len(numbers) == MAX_CALCULATION_TERMS:
                return None
            numbers.append(float(number))
        else:
            operators.append(op)
        position = m.end()
    if not numbers or len(numbers) != len(operators) + 1:
        return None
    total, term, sign = 0.0, numbers[0], 1.0
    for op, number in zip(operators, numbers[1:]):
        if op == "*":
            term *= number
        elif op == "/":
            if number == 0:
                return None
            term /= number
        else:
            total += sign * term
            term, sign = number, (1.0 if op == "+" else -1.0)
    total += sign * term
    return total if math.isfinite(total) else None


def calculations(sentence: str) -> list[tuple[set[str], str, bool]]:
    """Each calculation the sentence writes out: its operands and result (normalised as
    :func:`key_facts` has them), and whether the result is right (to the digits written).
    Arithmetic it cannot check (malformed, too long, dividing by zero) is left out: not checked."""
    found = []
    position = 0
    while (m := _EXPRESSION.search(sentence, position)) is not None:
        equals = _RESULT.match(sentence, m.end()) if m.group(1) else None  # operators, then "="
        if equals is None:
            position = m.end()
            continue
        position = equals.end()
        left, result = m.group(0), equals.group(1)
        expression = _THOUSANDS.sub("", left).replace("×", "*").replace("x", "*").replace("−", "-").replace("÷", "/")
        written = _THOUSANDS.sub("", result)
        value = _arithmetic(expression)
        if value is None or len(written) - written.count(",") - written.count(".") > MAX_NUMBER_DIGITS:
            continue
        try:
            shown = float(written)
        except ValueError:  # "1,2" (a comma that is not a thousands separator)
            continue
        decimals = len(written.partition(".")[2])
        right = abs(value - shown) <= 0.5 * 10**-decimals + 1e-9 * abs(value)
        found.append((_numbers(left), _normal_number(result), right))
    return found


def fact_gate(sentence: str, question: str, chunk_texts: Sequence[str]) -> tuple[list[bool], set[str]]:
    """Which chunks may support ``sentence`` by its key facts, and the facts no chunk contains.

    No key fact in any chunk: no chunk may (the claim is not in the documents). Otherwise the
    chunks holding every fact that some chunk holds may; when none holds them all, the chunks
    holding some (facts spread over documents). Facts found nowhere are returned as missing:
    the sentence is then at most partly supported. A calculation's right result is not looked
    for; a wrong one, or an operand found nowhere, makes the sentence not supported.
    """
    nowhere = [False] * len(chunk_texts)
    absent = absent_subjects(sentence, question, chunk_texts)
    if absent:  # the answer is about something no document mentions ("the Marrowick cinema")
        return nowhere, absent
    facts = key_facts(sentence, question)
    worked = calculations(sentence)
    derived = {result for _, result, right in worked if right}
    facts = {f for f in facts if f.partition(" ")[0] not in derived}  # a fact's number ("12 beds" -> "12")
    if not facts:
        return [True] * len(chunk_texts), set()
    context = context_stems(sentence, question, facts)
    found = [facts_in(facts, text, context) for text in chunk_texts]
    present = set().union(*found)
    missing = facts - present
    wrong = {result for _, result, right in worked if not right}
    operand_numbers = set().union(*(numbers for numbers, _, _ in worked))
    operands = {f for f in missing if f.partition(" ")[0] in operand_numbers}
    if wrong or operands:  # the claim is the calculation: a wrong result or an unsourced operand sinks it
        return nowhere, missing | wrong
    if not present:
        return nowhere, missing
    whole = [f == present for f in found]
    return (whole if any(whole) else [bool(f) for f in found]), missing


def choose_gated(row: Sequence[float], gate: tuple[list[bool], set[str]] | None, threshold: float, margin: float) -> tuple[int, ...]:
    """:func:`choose` among the chunks ``gate`` (from :func:`fact_gate`; None: all) lets support
    the sentence. A chunk holding the sentence's numbers and names is evidence enough: the
    similarity threshold applies only where the gate did not narrow the choice."""
    if gate is None:
        return choose(row, threshold, margin)
    eligible = gate[0]
    if not any(eligible):
        return ()
    gated = [score if ok else float("-inf") for score, ok in zip(row, eligible)]
    return choose(gated, threshold if all(eligible) else float("-inf"), margin)


def with_attention(row: Sequence[float], shares: Sequence[float], weight: float) -> list[float]:
    """Evidence scores plus ``weight`` times each chunk's attention share relative to the best one."""
    best = max(shares, default=0.0)
    if best <= 0:
        return list(row)
    return [score + weight * share / best for score, share in zip(row, shares)]


def choose(row: Sequence[float], threshold: float, margin: float, max_cited: int = 3) -> tuple[int, ...]:
    """0-based chunk indices cited for one sentence's scores: the best when it clears
    ``threshold``, with every chunk within ``margin`` of it (at most ``max_cited``), best first."""
    if not row:
        return ()
    best = max(row)
    if best < threshold:
        return ()
    return tuple(sorted((i for i, s in enumerate(row) if s >= best - margin), key=lambda i: -row[i])[:max_cited])


def score_matrices(
    embedder: Embedder, question: str, sentences: Sequence[str], chunk_texts: Sequence[str], methods: Sequence[str] = METHODS
) -> dict[str, list[list[float]]]:
    """``{method: [sentence][chunk] scores}`` for several methods, embedding each text once."""
    lexical = [[lexical_support(s, c) for c in chunk_texts] for s in sentences]
    out: dict[str, list[list[float]]] = {}
    if "lexical" in methods:
        out["lexical"] = lexical
    if {"embedding", "hybrid"} & set(methods):
        vectors = embedder.embed([f"{question} {s}" for s in sentences] + list(chunk_texts))
        queries, chunks = vectors[: len(sentences)], vectors[len(sentences) :]
        cosine = [[sum(a * b for a, b in zip(q, c)) for c in chunks] for q in queries]
        if "embedding" in methods:
            out["embedding"] = cosine
        if "hybrid" in methods:
            out["hybrid"] = [[cos + lex for cos, lex in zip(crow, lrow)] for crow, lrow in zip(cosine, lexical)]
    return out


class EvidenceAttributor:
    def __init__(
        self,
        embedder: Embedder,
        *,
        method: str = "hybrid",
        threshold: float | None = None,
        margin: float | None = None,
        fact_check: bool = True,
        attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
    ):
        if method not in METHODS:
            raise ValueError(f"attribution method must be one of {METHODS}, got {method!r}")
        self.embedder = embedder
        self.method = method
        self.threshold = threshold if threshold is not None else DEFAULT_THRESHOLDS[method]
        self.margin = margin if margin is not None else DEFAULT_MARGINS[method]
        self.fact_check = fact_check  # False: similarity alone (the behaviour before the key-fact gate)
        self.attention_weight = attention_weight  # the attention route: weight of the run's own attention

    def settings(self) -> dict[str, object]:
        return {
            "method": self.method,
            "threshold": self.threshold,
            "margin": self.margin,
            "fact_check": self.fact_check,
            "attention_weight": self.attention_weight,
        }

    def scores(self, question: str, sentences: Sequence[str], chunk_texts: Sequence[str]) -> list[list[float]]:
        """``[sentence][chunk]`` support scores."""
        return score_matrices(self.embedder, question, sentences, chunk_texts, (self.method,))[self.method]

    def attribute(self, question: str, answer: str, chunk_texts: Sequence[str], attention: Sequence[Sequence[float]] | None = None) -> list[SentenceSupport]:
        """Each answer sentence's support. ``attention`` (the attention route): per sentence, the
        run's attention share of each chunk (:func:`snapkv_rag.compression.span_attention.sentence_attention`),
        added to the evidence scores as ``attention_weight * share / best share``."""
        sentences = answer_sentences(answer)
        if not sentences or not chunk_texts:
            return []
        scores = self.scores(question, sentences, chunk_texts)
        if attention is not None:
            scores = [with_attention(row, shares, self.attention_weight) for row, shares in zip(scores, attention)]
        out = []
        for sentence, row in zip(sentences, scores):
            if sentence.endswith("?"):  # a question (often the user's own, echoed) claims nothing to cite or check
                out.append(SentenceSupport(sentence, (), (), ()))
                continue
            gate = fact_gate(sentence, question, chunk_texts) if self.fact_check else None
            chosen = choose_gated(row, gate, self.threshold, self.margin)
            missing = tuple(sorted(gate[1])) if gate else ()
            out.append(SentenceSupport(sentence, tuple(i + 1 for i in chosen), tuple(round(row[i], 4) for i in chosen), missing))
        return out


def sweep(embedder: Embedder, question: str, answer: str, chunk_texts: Sequence[str], grid: Sequence[tuple[str, float, float]]) -> dict[str, list[int]]:
    """Cited document numbers (1-based, sorted) under each ``(method, threshold, margin)`` of
    ``grid``, keyed ``"method:threshold=T,margin=M"``; each method's scores are computed once."""
    sentences = answer_sentences(answer)
    matrices = score_matrices(embedder, question, sentences, chunk_texts, sorted({m for m, _, _ in grid})) if sentences and chunk_texts else {}
    gates = [fact_gate(s, question, chunk_texts) for s in sentences]
    out = {}
    for method, threshold, margin in grid:
        cited: set[int] = set()
        for row, gate in zip(matrices.get(method, []), gates):
            cited.update(i + 1 for i in choose_gated(row, gate, threshold, margin))
        out[sweep_key(method, threshold, margin)] = sorted(cited)
    return out


def sweep_key(method: str, threshold: float, margin: float) -> str:
    return f"{method}:threshold={threshold:g},margin={margin:g}"
