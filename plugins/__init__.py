"""gcpatch's built-in plugins, one module per framework. Installed as `gcpatch_plugins`."""
