"""The `gcpatch` command (`cli`) and its subcommands `doctor` and `explain`."""
