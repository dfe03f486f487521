package main

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// commandLine's output, pasted into bash, gives back exactly the arguments it was made
// from, with "--" before the positional ones: a key starting with '-', shell syntax ($,
// backquotes, quotes), white space, characters that do not print and invalid UTF-8.
func TestCommandLineRoundTripsThroughBash(t *testing.T) {
	t.Parallel()
	bash, err := exec.LookPath("bash")
	require.NoError(t, err, "bash reads the $'…' form; Debian, CI's system, has it")
	args := []string{"mail", "-K9gGyX8OAK8aH8Myj6djqQ:8e03", "it's", "$HOME", "back`tick`", `quote"d\`,
		"a  b ", "tab\there", "new\nline", "zero\u200bwidth", "caf\xe9", "", "idem store", "ordre-é"}
	for _, arg := range args {
		line := commandLine([]string{"--schema", arg, "records", "show"}, arg, "k")
		require.True(t, strings.HasPrefix(line, "pgidem "), line)
		// A function named pgidem prints each argument it gets, NUL-terminated.
		out, err := exec.Command(bash, "-c", `pgidem() { printf '%s\0' "$@"; }; `+line).Output()
		require.NoError(t, err, line)
		require.Equal(t, []string{"--schema", arg, "records", "show", "--", arg, "k", ""}, strings.Split(string(out), "\x00"), line)
		require.NotContains(t, line, "\n", "a hint stays on one line")
	}
	require.Equal(t, "pgidem records show -- mail order-9.invoice", commandLine([]string{"records", "show"}, "mail", "order-9.invoice"),
		"plain names stay bare")
}
