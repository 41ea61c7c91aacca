from gcpatch.commands.cli import main

raise SystemExit(main())
