"""``python -m cli``: the ``retexo`` command line, as the console script runs it."""

from cli.app import main

if __name__ == "__main__":
    main()
