"""``ps-keys``: make and inspect job secrets and CURVE key files.

``ps-keys secret FILE`` writes a master job secret (``--role R --from MASTER``: one role's
secret), ``ps-keys generate DIR NAME`` a CURVE key pair, ``ps-keys show FILE`` prints a key
file's public key, ``ps-keys init DIR`` makes a ready-to-use set for a single-host run and
prints the YAML for it.
"""

from __future__ import annotations

import argparse
import json
import sys

from ps_common.errors import PsError
from ps_common.security.credentials import ROLES, generate_master, load_secret, write_role_secret
from ps_common.security.keys import SecurityError, generate_keypair, load_public_key
from ps_common.security.settings import init_local_keys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ps-keys", description="job secrets and CURVE key files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sec = sub.add_parser("secret", help="write a job secret file (0600): a master, or one role's "
                                        "secret derived from a master (--role R --from MASTER)")
    sec.add_argument("file")
    sec.add_argument("--role", choices=ROLES, default=None)
    sec.add_argument("--from", dest="master", default=None, help="the master secret file")
    sec.add_argument("--force", action="store_true", help="overwrite an existing file")
    g = sub.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    g.add_argument("dir")
    g.add_argument("name", help="ROLE or ROLE-HOST: the servers read the role from the file name")
    g.add_argument("--force", action="store_true", help="overwrite existing files")
    s = sub.add_parser("show", help="print the public key (z85) of a .key or .key_secret file")
    s.add_argument("file")
    i = sub.add_parser("init", help="a server key and one key per client role for a single-host "
                                    "run; prints the YAML")
    i.add_argument("dir")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "secret":
            if args.role is None:
                if args.master:
                    raise SecurityError("--from needs --role (a master is made from nothing)")
                generate_master(args.file, overwrite=args.force)
            else:
                if not args.master:
                    raise SecurityError("--role needs --from MASTER_FILE")
                write_role_secret(args.file, load_secret(args.master), args.role, overwrite=args.force)
            print(args.file)
        elif args.cmd == "generate":
            public, secret = generate_keypair(args.dir, args.name, overwrite=args.force)
            print(public)
            print(secret)
        elif args.cmd == "show":
            print(load_public_key(args.file).decode("ascii"))
        else:
            cfg = init_local_keys(args.dir)
            print("security:")
            for k, v in cfg.model_dump().items():
                if v is not None:
                    print(f"  {k}: {json.dumps(v)}")
    except (PsError, OSError) as exc:  # a file tool: a file that cannot be read or written is the user's
        print(f"ps-keys: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
