"""kvsum/calibrate/text.py: calibration text, disjoint from the evaluation haystack."""

from kvsum.calibrate import calibration_text


def _shared_paragraphs(text: str) -> set[str]:
    from kvsum.eval.text import paragraphs

    flat = " ".join(text.split())
    own = {" ".join(p.split()) for p in text.split("\n\n")}
    return {p for p in paragraphs() if p in flat or p in own}


def test_calibration_text_is_disjoint_from_haystack():
    from kvsum.eval.text import paragraphs

    text = calibration_text()
    assert text == calibration_text() and len(text) >= 60_000 and "def " in text and "import " in text
    assert _shared_paragraphs(text) == set()
    leak = paragraphs()[3]
    assert _shared_paragraphs(text[:5000] + "\n\n" + leak) == {leak}  # the check does see a shared paragraph
