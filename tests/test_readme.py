"""The README prints the code's exit-code table, not a copy that drifts."""
from pathlib import Path

from qwen35rl.exit_codes import table


def test_the_readme_shows_the_exit_code_table_of_the_code():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert table(markdown=True).strip() in readme
