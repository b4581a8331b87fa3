import pytest

from jaxdist_lessons.tables import Table, human_bytes


def test_table_text_and_html():
    table = Table(
        ["model", "bytes"], [["GPT-3", 700_000_000_000], ["tiny", 0.5]], title="weights"
    )
    assert str(table).splitlines() == [
        "weights",
        "model            bytes",
        "-----  ---------------",
        "GPT-3  700,000,000,000",
        " tiny              0.5",
    ]
    html = table._repr_html_()
    assert "<caption>weights</caption>" in html and ">700,000,000,000</td>" in html
    assert html.count("<tr>") == 3 and html.count("<td ") == 4


def test_rows_must_match_headers():
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        Table(["a", "b"], [[1]])


@pytest.mark.parametrize(
    "n, binary, text",
    [
        (700e9, False, "700.0 GB"),
        (700e9, True, "651.9 GiB"),
        (2.8e12, False, "2.8 TB"),
        (512, False, "512 B"),
        (1536, True, "1.5 KiB"),
    ],
)
def test_human_bytes(n, binary, text):
    assert human_bytes(n, binary) == text


def test_values_keep_the_rows_unformatted():
    table = Table(["name", "bytes", "ratio"], [["a", 1234567, 0.123456]])
    assert table.values == [["a", 1234567, 0.123456]]
    assert table.rows == [["a", "1,234,567", "0.1235"]]
