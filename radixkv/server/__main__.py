from radixkv.server.cli import main

raise SystemExit(main())
