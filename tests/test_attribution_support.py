"""A citation can say "not supported" (issue 31, item 1): an answer sentence whose numbers,
names or dates appear in no stuffed chunk is cited by none, however similar it reads."""

from __future__ import annotations

import pytest

from snapkv_rag.rag.attribution import EvidenceAttributor, fact_gate, key_facts, split_sentences

LIGHTHOUSE = "# Tessaly Lighthouse\n\nThe lighthouse on Tessaly Island was built in 1871 and its lamp can be seen 22 nautical miles away."
BAKERY = "The island bakery opens at 7:00 and sells rye bread, honey cake and buns. It is run by Mara Penhallow."
FERRY = "Ferry to Tessaly. On weekdays the first ferry leaves Tessaly at 6:15 and the last one at 21:40. A ticket costs 3.40 crowns."
CHUNKS = [LIGHTHOUSE, BAKERY, FERRY]


@pytest.fixture(scope="module")
def attributor():
    from snapkv_rag.rag import Embedder

    return EvidenceAttributor(Embedder())


def test_key_facts_are_numbers_and_names_the_question_does_not_hold():
    q = "How many pupils attend the primary school on Tessaly Island?"
    assert key_facts("The primary school on Tessaly Island is 100.", q) == {"100"}
    assert key_facts("It leaves at 06:40 on Monday.", "When?") == {"6:40", "monday"}
    assert key_facts("The library holds 182,000 volumes.", "") == {"182000 volumes"}  # a count keeps what it counts


def test_numbers_match_in_their_written_forms():
    assert fact_gate("It leaves at 06.15.", "When?", CHUNKS) == ([False, False, True], set())


def test_an_invented_number_is_not_supported_by_similar_documents(attributor):
    q = "How many pupils attend the primary school on Tessaly Island?"
    (support,) = attributor.attribute(q, "The primary school on Tessaly Island is 100.", CHUNKS)
    assert support.numbers == () and not support.supported
    assert set(support.missing) == {"primary", "school"}  # no document talks about a school at all


def test_a_wrong_time_is_not_supported_by_the_ferry_file(attributor):
    q = "What time does the first ferry leave Tessaly on weekdays?"
    (wrong,) = attributor.attribute(q, "The first ferry leaves at 12:30.", CHUNKS)
    assert wrong.numbers == () and wrong.missing == ("12:30",)
    (right,) = attributor.attribute(q, "The first ferry leaves at 6:15.", CHUNKS)
    assert right.numbers == (3,) and right.missing == ()


def test_abbreviations_titles_and_decimals_do_not_end_a_sentence():
    assert split_sentences("It leaves at 6:40 a.m. on weekdays, e.g. Monday. Dr. Hale and J. R. Penn run St. Aldric's. It costs 3.40 crowns!") == [
        "It leaves at 6:40 a.m. on weekdays, e.g. Monday.",
        "Dr. Hale and J. R. Penn run St. Aldric's.",
        "It costs 3.40 crowns!",
    ]
    # a marker after the full stop stays with its sentence; a line break always ends one
    assert split_sentences("The last one is at 9 p.m. [2] Tickets cost 3.40.\n- one\n- two") == [
        "The last one is at 9 p.m. [2]",
        "Tickets cost 3.40.",
        "- one",
        "- two",
    ]


def test_a_time_with_am_is_one_sentence_partly_supported(attributor):
    q = "What time does the first ferry leave Tessaly on weekdays?"
    (support,) = attributor.attribute(q, "The first ferry leaves at 6:15 a.m. on weekdays, which is 1 hour and 40 minutes.", CHUNKS)
    assert support.numbers == (3,) and set(support.missing) == {"1 hour", "40 minutes"}


def test_an_echoed_question_is_neither_cited_nor_flagged(attributor):
    q = "What time does the cinema on Tessaly open on Sundays?"
    echo, answer = attributor.attribute(q, f"## Question: {q} The cinema opens at 12:30.", CHUNKS)
    assert (echo.numbers, echo.missing) == ((), ())  # its "cinema" is the user's word, not a claim
    assert not answer.supported and "cinema" in answer.missing


def test_a_partly_invented_sentence_is_cited_where_its_true_facts_are(attributor):
    q = "What time does the first ferry leave Tessaly on weekdays?"
    (support,) = attributor.attribute(q, "The first ferry leaves at 6:15, which is 1 hour and 40 minutes.", CHUNKS)
    assert support.numbers == (3,) and set(support.missing) == {"1 hour", "40 minutes"}


def test_a_count_of_something_else_does_not_support_a_count(attributor):
    (support,) = attributor.attribute("What is the height of the lighthouse?", "The lighthouse is 22 metres high.", CHUNKS)
    assert support.numbers == () and support.missing == ("22 metres",)  # the chunk's 22 counts nautical miles


def test_sentences_without_key_facts_keep_the_similarity_choice(attributor):
    (support,) = attributor.attribute("What does the bakery sell?", "The bakery sells rye bread and honey cake.", CHUNKS)
    assert support.numbers[0] == 2 and support.missing == ()


def test_the_cli_says_not_supported():
    from types import SimpleNamespace as NS

    from snapkv_rag.rag.attribution import SentenceSupport
    from snapkv_rag.rag.cli import _describe

    stats = NS(
        kept_tokens_per_layer=[10],
        compression=None,
        compression_ratio=1.0,
        compression_ratio_text="1.00",
        prefill_seconds=0.1,
        decode_ms_per_token=None,
        segment_reuse=None,
        reused_prompt_tokens=0,
        policy_stats={},
    )
    answer = NS(
        citations=[],
        sources=[],
        invalid_citations=[],
        context=NS(chunks=[], document_tokens=20, budget_tokens=100, left_out=0, duplicates=0, settings={}),
        result=NS(stats=stats, usage=NS(prompt_tokens=40)),
        unsupported=[SentenceSupport("The primary school is 100.", (), (), ("100",))],
    )
    text = "\n".join(_describe(answer))
    assert 'NOT SUPPORTED by the stuffed documents: "The primary school is 100." (no stuffed document contains 100)' in text


VISITORS = "The Tessaly museum counted 7,699 visitors in 2019 and charged 10 crowns a ticket."


def test_a_wrong_calculation_is_not_supported_though_its_operands_are(attributor):
    """Issue 51, item 11: "So, 7,699 * 10 = 769" was cited, partly supported, by the chunk holding 7,699 and 10."""
    q = "What did the museum take in tickets in 2019?"
    assert fact_gate("So, 7,699 * 10 = 769.", q, [VISITORS, FERRY]) == ([False, False], {"769"})
    (support,) = attributor.attribute(q, "So, 7,699 * 10 = 769.", [VISITORS, FERRY])
    assert not support.supported and support.missing == ("769",)


def test_a_right_calculation_is_supported_where_its_operands_are():
    q = "What did the museum take in tickets in 2019?"
    assert fact_gate("So, 7,699 * 10 = 76,990 crowns.", q, [VISITORS, FERRY]) == ([True, False], set())
    assert fact_gate("That is 10 / 3 = 3.33 each.", q, [VISITORS]) == ([False], {"3"})  # 3 comes from nowhere
    assert fact_gate("It took 7,699 + 1 = 7,700 tickets.", q, [VISITORS]) == ([False], {"1"})


def test_a_sentence_without_a_calculation_is_still_partly_supported():
    q = "When does the first ferry leave?"
    gate, missing = fact_gate("The first ferry leaves Tessaly at 6:15, which is 1 hour and 40 minutes early.", q, CHUNKS)
    assert gate == [False, False, True] and missing == {"1 hour", "40 minutes"}
