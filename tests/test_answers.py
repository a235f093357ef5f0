"""The answers a report shows: both models' greedy answers decoded side by side, and the held-out accuracy
before and after when the rows carry their answers."""

from __future__ import annotations

from txflow.training.answers import side_by_side


class Digits:
    """A tokenizer whose token i is the text str(i % 10), and 10 is the end of a turn (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids if i != 10)


def test_answers_side_by_side_and_the_accuracy_of_each_model():
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 2 + 3?", "answer": "5"},
            {"prompt": "What is 4 + 4?", "answer": "8"}]
    base = [[9, 10], [5, 10], [1, 2]]
    trained = [[2, 10], [5, 10], [8, 10]]
    shown, figures = side_by_side(Digits(), rows, base, trained, shown=2)
    assert shown == [{"prompt": "What is 1 + 1?", "base": "9", "trained": "2", "expected": "2"},
                     {"prompt": "What is 2 + 3?", "base": "5", "trained": "5", "expected": "5"}]
    assert figures == {"base_accuracy": 1 / 3, "accuracy": 1.0}  # over every held-out prompt, not the shown


def test_rows_without_answers_are_shown_without_an_accuracy():
    shown, figures = side_by_side(Digits(), [{"prompt": "Say a number"}], [[4]], [[7]])
    assert shown == [{"prompt": "Say a number", "base": "4", "trained": "7"}] and figures == {}
