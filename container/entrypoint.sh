#!/bin/sh
# The image's entrypoint (after tini). SageMaker runs `docker run IMAGE serve`:
#   serve [ARGS]   exec sagelmi serve [ARGS]
#   anything else  runs as given (docker run IMAGE bash -c '...', IMAGE sagelmi config ...)
set -e
if [ "${1:-serve}" = serve ]; then
    [ $# -gt 0 ] && shift
    exec sagelmi serve "$@"
fi
exec "$@"
