#!/bin/bash
# The kernel starvation behind issue 31, without vLLM: two sessions (scheduler autogroups) share core 1.
# Group B: a CPU loop on core 1, a task waking every PERIOD s on core 1, and (CORE0=yes) a CPU loop on core 0,
# so that B's weight on core 1 changes at every wake-up. Group A: one CPU loop on core 1. Prints each one's
# share of core 1 over 4 s. On 6.18.44 (this machine) A gets 0% while B spans both cores and wakes at 2 kHz;
# in one session, or with B on core 1 alone, they share it.
#   usage: kbug.sh PERIOD CORE0(yes|no) SPINNER(spin|spin_yield) SEPARATE_SESSIONS(1|0)
#   e.g.   kbug.sh 0.0005 yes spin 1
P=$1; C0=$2; SP=$3; SEP=$4; Y="$(dirname "$(readlink -f "$0")")/yieldtest.py"; PIDFILE=$(mktemp)
groupB() {
  [ "$C0" = yes ] && taskset -c 0 python3 "$Y" spin 7 &
  [ "$P" != 0 ] && taskset -c 1 python3 "$Y" waker 7 "$P" &
  taskset -c 1 python3 "$Y" "$SP" 7 & echo $! > "$PIDFILE"
  wait
}
if [ "$SEP" = 1 ]; then export -f groupB; export P C0 SP Y PIDFILE; setsid bash -c groupB & else groupB & fi
sleep 0.5
if [ "$SEP" = 1 ]; then setsid taskset -c 1 python3 "$Y" spin 6 & else taskset -c 1 python3 "$Y" spin 6 & fi
A=$!; sleep 1; B=$(cat "$PIDFILE")
a0=$(awk '{print $1}' /proc/$A/schedstat); b0=$(awk '{print $1}' /proc/$B/schedstat); sleep 4
a1=$(awk '{print $1}' /proc/$A/schedstat); b1=$(awk '{print $1}' /proc/$B/schedstat)
echo "waker_period=$P core0_loop=$C0 B=$SP separate_sessions=$SEP: A got $(( (a1-a0)/40000000 ))% of core 1, B's loop $(( (b1-b0)/40000000 ))%"
wait; rm -f "$PIDFILE"
