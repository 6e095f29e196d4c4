from radixkv.server import main

raise SystemExit(main())
