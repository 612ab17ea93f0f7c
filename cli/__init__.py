"""The `tandem` command line: `main` builds one parser from each command module's `add_commands`
and runs the command it parses. It stands above every other package (it starts the cluster, the
router and the planner, and talks to a running cluster through the client SDK), and nothing below
imports it; each module holds one group of commands and reaches into the packages only to call them.
"""
