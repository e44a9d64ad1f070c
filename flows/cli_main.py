"""`python -m flows.cli_main` runs the CLI without the console script."""
from flows.cli import app

if __name__ == "__main__":
    app()
