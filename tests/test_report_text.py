"""`ettr report`'s text columns."""


def test_a_step_under_half_a_millisecond_is_not_shown_as_zero():
    # The attempts table showed `0.000` for a 0.12 ms step (docs trial): a number that reads as no time.
    from ettr.report.text import _step_s

    assert _step_s(0.00012) == "0.00012" and _step_s(0.049) == "0.049" and _step_s(12.34) == "12.3"
    assert _step_s(None) == "-" and _step_s(0.0) == "0.000"
