#!/usr/bin/env python
"""Django's command-line utility. With the embedded database, a command run while the
service is stopped starts Postgres for its own duration (except `restore`, which builds a
fresh data dir and must not find an empty server initialised there first)."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
    from django.core.management import execute_from_command_line

    from memsite.launcher import embedded_database_for_command

    if sys.argv[1:2] == ["restore"]:
        execute_from_command_line(sys.argv)
        return
    with embedded_database_for_command():
        execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
