#!/usr/bin/env bash
# faultline-watch.sh: react to your own node's device health from a shell (bash + jq).
#
#   faultline-watch.sh --file /config/fault.json [--exit-on-failed]          # the node's own fault.json
#   faultline-watch.sh --dir /config --node "$NODE_NAME" [--exit-on-failed]   # shard ConfigMaps
#   faultline-watch.sh --file /config/fault.json --pod-uid "$POD_UID" --exit-on-drain
#   faultline-watch.sh --ack "http://$HOST_IP:8082" --pod-uid "$POD_UID"     # I have checkpointed
#   options: --device ID (repeatable: id, UUID or bus id)  --interval SECONDS (0.5)
#
# Prints one line per device whenever a status changes: "<node> <device> <status>
# <reason or ->"; "<node> - unknown not-published" while the node has no entry;
# "<node> - unknown verdict-stale" (or no-verdict) first while the node's verdict is not
# confirmed: as the agent says (verdict.stale), or by its age when nobody rewrites the
# file (verdict.confirmed older than verdict.stale_after_s + 5 s); then its healthy
# devices read "unknown verdict-stale". With --exit-on-failed it prints
# "FAILED <node> <device> <reason>" and exits 3. Each drain intent of the node (a pod
# warned before its eviction, docs/remediation.md#warn-before-evicting) is a line
# "<node> - drain <namespace>/<pod> <evict_after> <reason>"; with --exit-on-drain, this
# pod's (--pod-uid, default $POD_UID) prints "DRAIN <namespace>/<pod>
# evict_after=<time> <reason>" and exits 4. --ack tells the node's agent this pod has
# checkpointed (bash's /dev/tcp, no curl needed): exit 0 taken, 1 refused.
#
# Files are swapped, never rewritten (kubelet's ..data symlink, the agent's rename), so
# the path is re-read on every look and what it says is compared: no file is held open.
set -u
dir= file= node=${NODE_NAME:-} interval=0.5 exit_on_failed= devices='[]'
pod_uid=${POD_UID:-} exit_on_drain= ack=
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --file) file=$2; shift 2 ;;
    --node) node=$2; shift 2 ;;
    --device) devices=$(jq -c --arg d "$2" '. + [$d]' <<<"$devices"); shift 2 ;;
    --interval) interval=$2; shift 2 ;;
    --exit-on-failed) exit_on_failed=1; shift ;;
    --pod-uid) pod_uid=$2; shift 2 ;;
    --exit-on-drain) exit_on_drain=1; shift ;;
    --ack) ack=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "faultline-watch: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$exit_on_drain$ack" ] && ! [[ $pod_uid =~ ^[A-Za-z0-9-]{1,64}$ ]]; then
  echo "faultline-watch: --exit-on-drain and --ack need --pod-uid or \$POD_UID (a UID)" >&2; exit 2
fi
if [ -n "$ack" ]; then
  hp=${ack#http://}; hp=${hp%%/*}
  [[ $hp =~ ^([^:]+):([0-9]+)$ ]] || { echo "faultline-watch: --ack http://HOST:PORT" >&2; exit 2; }
  body="{\"uid\":\"$pod_uid\"}"
  if ! exec 3<>"/dev/tcp/${BASH_REMATCH[1]}/${BASH_REMATCH[2]}"; then
    echo "faultline-watch: cannot reach $ack" >&2; exit 1
  fi
  printf 'POST /v1/drain/ack HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
    "$hp" "${#body}" "$body" >&3
  answer=$(cat <&3); exec 3<&-
  status=$(head -n1 <<<"$answer" | cut -d' ' -f2)
  if [ "$status" = 202 ] || [ "$status" = 200 ]; then echo "acknowledged $pod_uid"; exit 0; fi
  echo "faultline-watch: acknowledgement refused: HTTP $status: $(tail -n1 <<<"$answer")" >&2; exit 1
fi
command -v jq >/dev/null || { echo "faultline-watch: jq is needed" >&2; exit 2; }
if [ -n "$dir" ]; then
  [ -n "$node" ] || { echo "faultline-watch: --dir needs --node or \$NODE_NAME" >&2; exit 2; }
  path=$dir/$node.json
elif [ -n "$file" ]; then
  path=$file
else
  echo "faultline-watch: --dir or --file" >&2; exit 2
fi

# The devices of one document, one "<node> <id> <status> <reason>" line each; fails on
# a document that is not a node document (or is another node's).
lines() {
  jq -r --arg node "$node" --argjson only "$devices" '
    if (.npus | type) != "array" then error("not a faultline node document") else . end
    | if $node != "" and .node != $node then error("document of node \(.node)") else . end
    | .node as $n
    | (.verdict | if type == "object" then . else null end) as $v
    # Stale: the agent says so, or the confirmation is older than the verdict holds.
    | ($v != null and ($v.stale == true
        or ((try ($v.confirmed | sub("\\.[0-9]+"; "") | fromdateiso8601) catch null) as $at
            | $at != null and ($v.stale_after_s | type) == "number"
              and now > $at + $v.stale_after_s + 5))) as $stale
    | if (.agent | type) == "object" and .agent.reachable == false
      then "\($n) - unknown agent-unreachable"
      else
        (if $stale then "\($n) - unknown \(if $v.writer then "verdict-stale" else "no-verdict" end)" else empty end),
        (.npus[]
         | select(($only | length) == 0 or ([.id, .uuid, .pci_bus_id] - ($only) | length) < 3)
         | if $stale and .status == "healthy" then .status = "unknown" | .reason = "verdict-stale" else . end
         | "\($n) \(.id) \(if (.status | IN("healthy","degraded","failed","unknown")) then .status else "unknown" end) \(.reason // "-")"),
        (.drain // [] | .[] | "\($n) - drain \(.namespace)/\(.pod) \(.evict_after) \(.reason // "-")")
      end'
}

# This pod's drain intent, as "DRAIN <namespace>/<pod> evict_after=<time> <reason>".
my_drain() {
  jq -r --arg uid "$pod_uid" '.drain // [] | .[] | select(.uid == $uid)
    | "DRAIN \(.namespace)/\(.pod) evict_after=\(.evict_after) \(.reason // "-")"' 2>/dev/null
}

last=
while :; do
  if text=$(cat "$path" 2>/dev/null); then
    if now=$(lines <<<"$text" 2>/dev/null); then :; else
      echo "faultline-watch: $path: not a node document of ${node:-this node}; keeping the last" >&2
      now=$last
    fi
  else
    now="${node:--} - unknown not-published"
  fi
  if [ "$now" != "$last" ]; then
    last=$now
    printf '%s\n' "$now"
    if [ -n "$exit_on_failed" ] && failed=$(grep -E '^[^ ]+ [^ ]+ failed ' <<<"$now"); then
      sed 's/^\([^ ]*\) \([^ ]*\) failed /FAILED \1 \2 /' <<<"$failed"
      exit 3
    fi
  fi
  # On every read, not only when the printed lines change (an unreachable agent's
  # entry prints one line, whatever its intents).
  if [ -n "$exit_on_drain" ] && [ -n "${text:-}" ] && mine=$(my_drain <<<"$text") && [ -n "$mine" ]; then
    printf '%s\n' "$mine"
    exit 4
  fi
  sleep "$interval"
done
