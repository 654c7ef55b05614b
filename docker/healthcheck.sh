#!/bin/bash
# HEALTHCHECK of the gpucast image: GET /healthz over bash's /dev/tcp (the slim image has no
# curl or wget, and the binary has no client subcommand). Exit 0 only on an HTTP 200 answer.
# The port is taken from GPUCAST_LISTEN (default 8080); the check always talks to loopback.
set -u
port="${GPUCAST_HEALTHCHECK_PORT:-${GPUCAST_LISTEN##*:}}"
port="${port:-8080}"
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1
printf 'GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
IFS= read -r -t 3 status_line <&3 || exit 1
exec 3<&-
case "$status_line" in
    "HTTP/1."[01]" 200"*) exit 0 ;;
    *) echo "healthz: ${status_line:-no answer}" >&2; exit 1 ;;
esac
