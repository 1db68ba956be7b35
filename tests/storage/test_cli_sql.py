"""`clawrl sql` in every output format, and its error path."""

from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from clawrl.cli import app
from clawrl.storage.writer import DataStore

QUERY = "SELECT turn_id, turn_index, output_ids, rollout_logprobs, created_at FROM turns ORDER BY turn_id"


@pytest.fixture
def cli(tmp_path, data_root, make_turn):
    turns = [make_turn(i, n_output=3) for i in range(3)]
    with DataStore(data_root, background=False) as store:
        store.append(turns)
        store.flush()
    conf = tmp_path / "conf.toml"
    conf.write_text(f'[storage]\ndata_root = "{data_root}"\n')
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(app, ["sql", *args, "--config", str(conf)], env={"COLUMNS": "200"})

    invoke.turns = turns
    return invoke


def test_sql_prints_a_table_by_default(cli):
    result = cli(QUERY)
    assert result.exit_code == 0, result.output
    for turn in cli.turns:
        assert turn.turn_id in result.output
    assert "3 rows" in result.output


def test_sql_csv_to_stdout(cli):
    result = cli(QUERY, "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["turn_id"] for r in rows] == [t.turn_id for t in cli.turns]
    assert [json.loads(r["output_ids"]) for r in rows] == [t.output_ids for t in cli.turns]
    assert json.loads(rows[1]["rollout_logprobs"]) == cli.turns[1].rollout_logprobs  # repr round-trips floats
    assert rows[0]["created_at"] == cli.turns[0].created_at.isoformat()


def test_sql_json_to_a_file(cli, tmp_path):
    out = tmp_path / "out.json"
    result = cli(QUERY, "--format", "json", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    rows = json.loads(out.read_text())
    assert [r["turn_index"] for r in rows] == [0, 1, 2]
    assert rows[2]["rollout_logprobs"] == cli.turns[2].rollout_logprobs


def test_sql_json_handles_aggregates(cli):
    result = cli("SELECT sum(turn_index) AS s, CAST(min(date) AS VARCHAR) AS d FROM turns", "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"s": 3, "d": "2026-11-29"}]  # 0 + 1 + 2; HUGEINT sum as an int


def test_sql_parquet_needs_out_and_writes_it(cli, tmp_path):
    result = cli(QUERY, "--format", "parquet")
    assert result.exit_code == 2
    assert "--out" in result.stderr
    out = tmp_path / "out.parquet"
    assert cli(QUERY, "--format", "parquet", "--out", str(out)).exit_code == 0
    table = pq.read_table(out)
    assert table.column("output_ids").to_pylist() == [t.output_ids for t in cli.turns]


def test_a_bad_query_prints_duckdbs_message_on_one_line_and_exits_2(cli):
    result = cli("SELECT no_such_column FROM turns")
    assert result.exit_code == 2
    assert 'Referenced column "no_such_column" not found' in result.stderr
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    # DuckDB's message is four lines (the error, a blank, the query echoed, a caret under it): one here
    result = cli("selec 1")
    assert result.exit_code == 2 and result.stderr.splitlines()[1:] == ['Parser Error: syntax error at or near "selec"']
    result = cli("select * from judgments")  # the view's name before it took its table's
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 2, result.stderr
    assert result.stderr.splitlines()[1].startswith("Catalog Error: Table with name judgments does not exist!")
    assert result.stderr.endswith(" (the view judgments is now verdicts)\n")


@pytest.mark.parametrize("query", ["", "  \n"])
def test_an_empty_query_is_refused_in_one_line(cli, query):
    result = cli(query)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == 'no query: give one, e.g. clawrl sql "select count(*) from turns"\n'


def test_the_row_count_under_a_table_is_singular_for_one_row(cli):
    assert cli("SELECT 1 AS one").stdout.split()[-2:] == ["1", "row"]
    assert cli("SELECT 1 AS one UNION ALL SELECT 2").stdout.split()[-2:] == ["2", "rows"]


def test_the_verdicts_view_is_named_as_its_table(tmp_path):
    """One name for one thing: the judge's verdicts are the ``verdicts`` table on disk and the view, and
    every verdict written (a retried judgment's too) is ``verdict_attempts``."""
    from clawrl.records import JudgeVerdict

    conf = tmp_path / "conf.toml"
    conf.write_text(f'[storage]\ndata_root = "{tmp_path / "root"}"\n')
    with DataStore(tmp_path / "root", background=False) as store:
        store.append([JudgeVerdict("t1", "h", "rule", -1, "majority", [-1], "[]"),
                      JudgeVerdict("t1", "h", "rule", 1, "majority", [1], "[]")])  # a retry: newer
        store.flush()
    result = CliRunner().invoke(app, ["sql", "SELECT (SELECT list(score) FROM verdicts) AS newest, (SELECT "
                                             "count(*) FROM verdict_attempts) AS attempts", "-f", "json",
                                      "-c", str(conf)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"newest": [1], "attempts": 2}]


def test_views_answer_on_a_fresh_data_root(tmp_path):
    conf = tmp_path / "conf.toml"
    conf.write_text(f'[storage]\ndata_root = "{tmp_path / "empty"}"\n')
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["sql", "SELECT count(*) AS n FROM turns", "-f", "csv", "-c", str(conf)])
    assert result.exit_code == 0, result.output
    assert result.stdout == "n\n0\n"


DUPLICATES = "SELECT 1 AS a, 2 AS a, 3 AS b, 4 AS a_1, 5 AS A"


def test_columns_of_one_name_keep_their_own_values_in_every_format(cli, tmp_path):
    """A join selecting two columns of one name must never show one column's value under the other's
    name: the duplicates are renamed as DuckDB names a table's columns (a_1, then a_1_1 past a taken a_1)."""
    expected = {"a": 1, "a_1": 2, "b": 3, "a_1_1": 4, "A_2": 5}
    as_json = cli(DUPLICATES, "-f", "json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == [expected]
    as_csv = cli(DUPLICATES, "-f", "csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [list(expected), ["1", "2", "3", "4", "5"]]
    out = tmp_path / "dup.parquet"
    assert cli(DUPLICATES, "-f", "parquet", "-o", str(out)).exit_code == 0
    assert pq.read_table(out).to_pylist() == [expected]
    table = cli(DUPLICATES)
    header, row = [line for line in table.stdout.splitlines() if "│" in line or "┃" in line][:2]
    assert header.replace("┃", " ").split() == list(expected)
    assert row.replace("│", " ").split() == ["1", "2", "3", "4", "5"]
