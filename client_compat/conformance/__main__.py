"""python -m client_compat.conformance --base-url URL [--api-key KEY] [--format text|markdown|json]"""

import argparse
import logging
import os
import sys

from client_compat.conformance import render_json, render_markdown, render_text, run_conformance

RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m client_compat.conformance",
                                     description="Check a Tinker-compatible server against the tinker SDK")
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"), required="TINKER_BASE_URL"
                        not in os.environ, help="the server (default: $TINKER_BASE_URL)")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-conformance"),
                        help="default: $TINKER_API_KEY, else tml-conformance")
    parser.add_argument("--base-model", default=None, help="default: the first model get_server_capabilities lists")
    parser.add_argument("--project-id", default="default", help="the project copy_weights copies into")
    parser.add_argument("--format", choices=sorted(RENDERERS), default="text")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the SDK logs every refused request; the table says it once
    outcomes = run_conformance(args.base_url, args.api_key, base_model=args.base_model, project_id=args.project_id)
    print(RENDERERS[args.format](outcomes))
    return 1 if any(o.status in ("fail", "unchecked") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
