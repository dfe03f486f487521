// Package docs_test checks the documentation against the module: every Go block of
// README.md and docs/*.md compiles, and every relative link leads to a file.
//
// A Go block is a fence opened with ```go. One that starts with a package clause is
// compiled as written, as a package of its own. Any other block is a fragment: a block
// of declarations (types, funcs) goes in at the top level, a block of statements into the
// body of a func returning error (so `return err` works). The fragments of one Markdown
// file share a package, so a later block can use what an earlier one declared, and a
// prelude declares ctx (context.Context), coord (*pgidem.Coordinator) and pool
// (*pgxpool.Pool) for them. A fragment needs no import lines: it gets those of the
// packages it refers to from a fixed list (knownImports). A fence whose previous
// non-blank line is <!-- not compiled --> is left out.
package docs_test

import (
	"bufio"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// notCompiled marks a fence the checker leaves out: a pure illustration.
const notCompiled = "<!-- not compiled -->"

// block is one Go fence of a Markdown file.
type block struct {
	doc  string // the Markdown file's absolute path
	line int    // line of the block's first line of code, 1-based
	code string
}

// docFiles returns README.md and docs/*.md under root.
func docFiles(t *testing.T, root string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{filepath.Join(root, "README.md")}, files...)
}

// goBlocks returns the Go blocks of the Markdown file path that are to be compiled.
func goBlocks(t *testing.T, path string) []block {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var (
		blocks   []block
		cur      *block
		indent   string
		lastText string // the previous non-blank line outside a fence
	)
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case cur != nil && trimmed == "```":
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			cur.code += strings.TrimPrefix(line, indent) + "\n"
		case trimmed == "```go":
			indent = line[:strings.Index(line, "```")]
			if lastText != notCompiled {
				cur = &block{doc: path, line: n + 1}
			} else {
				cur = &block{} // read and dropped
			}
		case strings.HasPrefix(trimmed, "```"):
			// Another language's fence: skip to its end.
			for sc.Scan() {
				n++
				if strings.TrimSpace(sc.Text()) == "```" {
					break
				}
			}
			lastText = ""
		case trimmed != "":
			lastText = trimmed
		}
	}
	if cur != nil {
		t.Fatalf("%s: the Go block at line %d has no closing fence", path, cur.line)
	}
	var kept []block
	for _, b := range blocks {
		if b.doc != "" {
			kept = append(kept, b)
		}
	}
	return kept
}

// prelude is the first file of each fragment package: the names fragments may use
// without declaring them.
const prelude = `package %s

import (
	"context"

	pgxpool "github.com/jackc/pgx/v5/pgxpool"

	pgidem "github.com/pgidem/pgidem/pgidem"
)

var (
	ctx   context.Context
	coord *pgidem.Coordinator
	pool  *pgxpool.Pool
)
`

// knownImports are the packages a fragment may use without importing them, by the name
// it uses: a fragment file imports those it refers to. Add a package here when a
// fragment needs one more.
var knownImports = map[string]string{
	"bytes":       `"bytes"`,
	"context":     `"context"`,
	"errors":      `"errors"`,
	"fmt":         `"fmt"`,
	"io":          `"io"`,
	"json":        `"encoding/json"`,
	"log":         `"log"`,
	"slog":        `"log/slog"`,
	"http":        `"net/http"`,
	"os":          `"os"`,
	"sql":         `"database/sql"`,
	"strconv":     `"strconv"`,
	"strings":     `"strings"`,
	"sync":        `"sync"`,
	"time":        `"time"`,
	"pgx":         `pgx "github.com/jackc/pgx/v5"`,
	"pgconn":      `pgconn "github.com/jackc/pgx/v5/pgconn"`,
	"pgxpool":     `pgxpool "github.com/jackc/pgx/v5/pgxpool"`,
	"river":       `river "github.com/riverqueue/river"`,
	"riverpgxv5":  `riverpgxv5 "github.com/riverqueue/river/riverdriver/riverpgxv5"`,
	"rivertype":   `rivertype "github.com/riverqueue/river/rivertype"`,
	"kgo":         `kgo "github.com/twmb/franz-go/pkg/kgo"`,
	"pgidem":      `pgidem "github.com/pgidem/pgidem/pgidem"`,
	"pgidemhttp":  `pgidemhttp "github.com/pgidem/pgidem/http"`,
	"pgidemotel":  `pgidemotel "github.com/pgidem/pgidem/otel"`,
	"pgidemriver": `pgidemriver "github.com/pgidem/pgidem/river"`,
	"pgidemtest":  `pgidemtest "github.com/pgidem/pgidem/pgidemtest"`,
	"migrations":  `migrations "github.com/pgidem/pgidem/migrations"`,
}

// module is a Go module in a temporary directory that requires the repository's module
// (replaced by its directory) and holds one package per Markdown file.
type module struct {
	dir, root string
	fragments []fragment
}

// fragment is a generated file of a fragment package, still without its imports.
type fragment struct {
	file, pkg, body string
}

// newModule writes go.mod (the repository's requirements, so the same versions) and
// go.sum.
func newModule(t *testing.T, root string) *module {
	t.Helper()
	dir := t.TempDir()
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	text := regexp.MustCompile(`(?m)^module .*$`).ReplaceAllString(string(gomod), "module pgidemdocs")
	text += "\nrequire github.com/pgidem/pgidem v0.0.0\n\nreplace github.com/pgidem/pgidem => " + strconv.Quote(root) + "\n"
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "go.mod"), text)
	write(t, filepath.Join(dir, "go.sum"), string(sum))
	return &module{dir: dir, root: root}
}

func write(t *testing.T, path, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// pkgName turns a Markdown path relative to the root into a package name.
func pkgName(rel string) string {
	name := strings.TrimSuffix(rel, ".md")
	name = regexp.MustCompile(`[^A-Za-z0-9]+`).ReplaceAllString(name, "_")
	return "doc_" + strings.ToLower(name)
}

// addDoc writes the blocks of one Markdown file into the module: whole files as they
// are, fragments once their imports are known (writeFragments).
func (m *module) addDoc(t *testing.T, blocks []block) {
	t.Helper()
	if len(blocks) == 0 {
		return
	}
	rel, err := filepath.Rel(m.root, blocks[0].doc)
	if err != nil {
		t.Fatal(err)
	}
	name := pkgName(rel)
	dir := filepath.Join(m.dir, name)
	write(t, filepath.Join(dir, "prelude.go"), fmt.Sprintf(prelude, name))
	for i, b := range blocks {
		// The line directive makes the compiler report positions in the Markdown file.
		directive := fmt.Sprintf("//line %s:%d\n", b.doc, b.line)
		if strings.HasPrefix(strings.TrimSpace(b.code), "package ") {
			// A whole file: a package of its own, compiled as written.
			write(t, filepath.Join(m.dir, fmt.Sprintf("%s_file%d", name, i), "main.go"), directive+b.code)
			continue
		}
		body := directive + b.code
		if _, err := parser.ParseFile(token.NewFileSet(), "", "package p\n"+b.code, parser.SkipObjectResolution); err != nil {
			// Not declarations: statements, in the body of a func.
			body = fmt.Sprintf("func block%d() error {\n%s%s%s}\n", i, directive, b.code, finalReturn(b.code))
		}
		m.fragments = append(m.fragments, fragment{file: filepath.Join(dir, fmt.Sprintf("block%d.go", i)), pkg: name, body: body})
	}
}

// finalReturn is the statement that ends a func body of statements: none when they end
// with a return already (vet would call another unreachable).
func finalReturn(code string) string {
	f, err := parser.ParseFile(token.NewFileSet(), "", "package p\nfunc _() error {\n"+code+"\n}", parser.SkipObjectResolution)
	if err == nil {
		if body := f.Decls[0].(*ast.FuncDecl).Body.List; len(body) > 0 {
			if _, ok := body[len(body)-1].(*ast.ReturnStmt); ok {
				return ""
			}
		}
	}
	return "return nil\n"
}

// writeFragments writes each fragment with the imports it refers to (knownImports)
// and its body byte for byte.
func (m *module) writeFragments(t *testing.T) {
	t.Helper()
	for _, f := range m.fragments {
		var sb strings.Builder
		sb.WriteString("package " + f.pkg + "\n\nimport (\n")
		for _, name := range packageRefs(t, f.body) {
			if line, ok := knownImports[name]; ok {
				sb.WriteString(line + "\n")
			}
		}
		sb.WriteString(")\n\n" + f.body)
		write(t, f.file, sb.String())
	}
}

// packageRefs returns the names body uses as the X of a selector X.Sel without declaring
// them: the packages it refers to.
func packageRefs(t *testing.T, body string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "", "package p\n"+body, 0)
	if err != nil {
		return nil // the build reports it, at its Markdown line
	}
	seen := map[string]bool{}
	var names []string
	ast.Inspect(f, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok && id.Obj == nil && !seen[id.Name] {
				seen[id.Name] = true
				names = append(names, id.Name)
			}
		}
		return true
	})
	return names
}

// build type-checks every package of the module (go vet, which links nothing) and returns
// its output.
func (m *module) build() (string, error) {
	cmd := exec.Command("go", "vet", "./...")
	cmd.Dir = m.dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestGoBlocksCompile compiles every Go block of README.md and docs/*.md against the
// module, in one build.
func TestGoBlocksCompile(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	m := newModule(t, root)
	total := 0
	for _, doc := range docFiles(t, root) {
		blocks := goBlocks(t, doc)
		total += len(blocks)
		m.addDoc(t, blocks)
	}
	m.writeFragments(t)
	if total == 0 {
		t.Fatal("no Go block found in README.md and docs/*.md")
	}
	if out, err := m.build(); err != nil {
		t.Fatalf("a Go block of the documentation does not compile (%v):\n%s", err, out)
	}
	t.Logf("%d Go blocks compiled", total)
}

// TestBrokenBlockFails holds the checker itself: a block that does not compile fails the
// build, and the error points at its line in the Markdown file.
func TestBrokenBlockFails(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	doc := filepath.Join(t.TempDir(), "broken.md")
	write(t, doc, "# Broken\n\nText.\n\n```go\n_, err := pgidem.Do(ctx, coord, \"mail\", \"k\", time.Hour, nil,\n\tfunc(ctx context.Context) (string, error) { return 42, nil })\nreturn err\n```\n\n"+
		notCompiled+"\n\n```go\nnot Go at all\n```\n")
	blocks := goBlocks(t, doc)
	if len(blocks) != 1 {
		t.Fatalf("want the one compiled block, got %d", len(blocks))
	}
	m := &module{dir: newModule(t, root).dir, root: filepath.Dir(doc)}
	m.addDoc(t, blocks)
	m.writeFragments(t)
	out, err := m.build()
	if err == nil {
		t.Fatalf("a block returning an int as a string compiled:\n%s", out)
	}
	if !strings.Contains(out, "broken.md:7:") {
		t.Fatalf("the error does not point at broken.md line 7:\n%s", out)
	}
}

// anchors returns the anchors GitHub gives the headings of the Markdown file path.
func anchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	drop := regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	out := map[string]bool{}
	inFence := false
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		out[strings.ReplaceAll(drop.ReplaceAllString(strings.ToLower(title), ""), " ", "-")] = true
	}
	return out
}

// TestRelativeLinks checks that every relative link of README.md and docs/*.md leads to a
// file or directory of the repository, and to a heading of a Markdown file when it names
// one.
func TestRelativeLinks(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, doc := range docFiles(t, root) {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, match := range link.FindAllStringSubmatch(string(data), -1) {
			target := match[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := doc
			if file != "" {
				path = filepath.Join(filepath.Dir(doc), file)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s: link %q: %v", doc, target, err)
				continue
			}
			if anchor != "" && strings.HasSuffix(path, ".md") && !anchors(t, path)[anchor] {
				t.Errorf("%s: link %q: no heading of %s has that anchor", doc, target, path)
			}
		}
	}
}

// TestReadmeLength keeps README.md a page a newcomer reads in ten minutes.
func TestReadmeLength(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(strings.Fields(string(data))); n > 1500 {
		t.Errorf("README.md has %d words (as wc -w counts them); keep it at 1500 or fewer and move detail to docs/", n)
	}
}
