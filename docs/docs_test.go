// Package docs_test checks the documentation: README.md and the pages in
// this directory. Links rot when pages or headings move, and a config field
// nobody documents is a field nobody finds; both fail here, in `make test`,
// rather than in a reader's browser.
package docs_test

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/picker"
)

// pages are the markdown files checked, relative to this directory.
func pages(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob("*.md")
	require.NoError(t, err)
	require.NotEmpty(t, docs, "no docs/*.md")
	return append([]string{"../README.md"}, docs...)
}

var (
	// fence matches a fenced code block: links and headings in it are text.
	fence = regexp.MustCompile("(?ms)^ *```.*?^ *```[^\n]*$")
	// link matches [text](target) and ![alt](target), an optional title
	// after the target.
	link = regexp.MustCompile(`\[[^\]\n]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	// heading matches an ATX heading.
	heading = regexp.MustCompile(`(?m)^#{1,6}[ \t]+(.+?)[ \t#]*$`)
)

// prose is a markdown file's text without its fenced code blocks.
func prose(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	return fence.ReplaceAllString(string(data), "")
}

// anchors are the fragments GitHub gives a page's headings: lowercased,
// punctuation but '-' and '_' dropped, spaces turned into '-', and a
// repeated anchor suffixed -1, -2, ...
func anchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(prose(t, path), -1) {
		a := githubAnchor(m[1])
		if n := seen[a]; n > 0 {
			seen[a]++
			a = fmt.Sprintf("%s-%d", a, n)
		} else {
			seen[a] = 1
		}
		out[a] = true
	}
	return out
}

func githubAnchor(text string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func TestGithubAnchor(t *testing.T) {
	for text, want := range map[string]string{
		"Reloading the config":                      "reloading-the-config",
		"FULL_DUPLEX_STREAMED (InferencePool mode)": "full_duplex_streamed-inferencepool-mode",
		"Kubernetes (Envoy Gateway)":                "kubernetes-envoy-gateway",
		"`pdx serve`, and docker-compose":           "pdx-serve-and-docker-compose",
		"Add a picking policy":                      "add-a-picking-policy",
		"What's new? 2.0":                           "whats-new-20",
		"Paths → pools — and more":                  "paths--pools--and-more",
	} {
		require.Equal(t, want, githubAnchor(text), text)
	}
}

// Every relative link of README.md and docs/*.md names a file or directory
// that exists, and every fragment into a page names one of its headings.
func TestRelativeLinks(t *testing.T) {
	var problems []string
	checked := 0
	for _, page := range pages(t) {
		for _, m := range link.FindAllStringSubmatch(prose(t, page), -1) {
			target := m[1]
			if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			file, frag, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), filepath.FromSlash(file))
				if _, err := os.Stat(path); err != nil {
					problems = append(problems, fmt.Sprintf("%s: link %s: %s does not exist", page, target, path))
					continue
				}
			}
			if frag == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			if !anchors(t, path)[frag] {
				problems = append(problems, fmt.Sprintf("%s: link %s: %s has no heading with anchor #%s", page, target, path, frag))
			}
		}
	}
	t.Logf("%d relative links checked", checked)
	require.Empty(t, problems, "broken links:\n%s", strings.Join(problems, "\n"))
	require.Greater(t, checked, 20, "so few relative links: is the link pattern still right?")
}

// configPages are where the config fields are documented: the reference
// page and the one it hands Kubernetes discovery to.
var configPages = []string{"configuration.md", "discovery.md"}

// fieldPath matches a config field path as the pages write it, e.g.
// grpc_address, tls.cert_file, pools[].prefill[].address or
// pools[].*[].kv_address.
var fieldPath = regexp.MustCompile(`^(?:[a-z0-9_]+|\*)(?:\[\])?(?:\.(?:[a-z0-9_]+|\*)(?:\[\])?)*$`)

// TestConfigFieldsDocumented: every field of every message of the config
// schema is named on the config pages, in backticks (`eject_duration`, or
// as a component of a path such as `pools[].eject_duration`) or as a table
// cell of its own.
func TestConfigFieldsDocumented(t *testing.T) {
	fields := map[string][]string{} // field name → messages that have it
	var walk func(protoreflect.MessageDescriptor)
	seen := map[protoreflect.FullName]bool{}
	walk = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			return
		}
		seen[md.FullName()] = true
		fs := md.Fields()
		for i := range fs.Len() {
			f := fs.Get(i)
			fields[string(f.Name())] = append(fields[string(f.Name())], string(md.Name()))
			if f.IsMap() || f.Message() == nil {
				continue
			}
			if strings.HasPrefix(string(f.Message().FullName()), "google.protobuf.") {
				continue
			}
			walk(f.Message())
		}
	}
	walk((&configv1.Config{}).ProtoReflect().Descriptor())
	require.Contains(t, fields, "grpc_address")
	require.Contains(t, fields, "kv_port", "the walk reaches nested messages")

	mentioned := map[string]bool{}
	mention := func(s string) {
		s = strings.TrimSpace(strings.Trim(strings.TrimSpace(s), "`"))
		if !fieldPath.MatchString(s) {
			return
		}
		for _, c := range strings.Split(s, ".") {
			mentioned[strings.TrimSuffix(c, "[]")] = true
		}
	}
	code := regexp.MustCompile("`([^`\n]+)`")
	for _, page := range configPages {
		text := prose(t, page)
		for _, m := range code.FindAllStringSubmatch(text, -1) {
			mention(m[1])
		}
		for _, line := range strings.Split(text, "\n") {
			if strings.HasPrefix(line, "|") {
				for _, cell := range strings.Split(line, "|") {
					mention(cell)
				}
			}
		}
	}

	var missing []string
	for name, messages := range fields {
		if !mentioned[name] {
			missing = append(missing, fmt.Sprintf("%s (of %s)", name, strings.Join(messages, ", ")))
		}
	}
	slices.Sort(missing)
	require.Empty(t, missing, "config fields that %s do not name (in backticks, alone or in a field path):\n%s",
		strings.Join(configPages, " and "), strings.Join(missing, "\n"))
}

// TestPoliciesDocumented: the placement page and the config reference
// name every registered picking policy, in backticks.
func TestPoliciesDocumented(t *testing.T) {
	require.NotEmpty(t, picker.Policies())
	for _, page := range []string{"placement.md", "configuration.md"} {
		text := prose(t, page)
		for _, name := range picker.Policies() {
			require.Contains(t, text, "`"+name+"`", "%s does not name policy %s", page, name)
		}
	}
}

// TestFolderMapMatchesTree checks that the architecture page's folder map
// names every directory of Go code in the module (in a row of its own or in
// its parent's row), and lists no directory that is not there: the map is
// how a newcomer finds their way.
func TestFolderMapMatchesTree(t *testing.T) {
	_, mapped, ok := strings.Cut(prose(t, "architecture.md"), "## Folder map")
	require.True(t, ok, "architecture.md has a Folder map section")
	mapped, _, _ = strings.Cut(mapped, "\n## ")
	row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")
	rows := row.FindAllStringSubmatch(mapped, -1)
	require.NotEmpty(t, rows)
	for _, m := range rows {
		info, err := os.Stat(filepath.Join("..", m[1]))
		require.NoError(t, err, "the folder map lists %s", m[1])
		require.True(t, info.IsDir(), "the folder map lists %s, which is not a directory", m[1])
	}

	var missing []string
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && path != ".." && strings.HasPrefix(d.Name(), "."):
			return filepath.SkipDir // .tools, .git
		case d.IsDir() || !strings.HasSuffix(path, ".go"):
			return nil
		}
		dir, err := filepath.Rel("..", filepath.Dir(path))
		if err != nil {
			return err
		}
		dir = filepath.ToSlash(dir)
		if !strings.Contains(mapped, "`"+dir+"`") && !slices.Contains(missing, dir) {
			missing = append(missing, dir)
		}
		return nil
	})
	require.NoError(t, err)
	require.Empty(t, missing, "directories of Go code that the folder map of architecture.md does not name")
}

// TestConnectorsDocumented: every registered connector has its row in the
// connectors page's table (aliases are named there too), and the
// configuration page names it among the values of pools[].connector.
func TestConnectorsDocumented(t *testing.T) {
	table := tableAt(t, "connectors.md", "| connector | protocol |")
	field, _, _ := strings.Cut(tableAt(t, "configuration.md", "| `pools[].connector` |"), "\n")
	for _, name := range connectors.Names() {
		spec, err := connectors.Lookup(name)
		require.NoError(t, err)
		code := "`" + name + "`"
		if spec.Names[0] == name {
			require.Regexp(t, `(?m)^\| `+regexp.QuoteMeta(code), table, "connectors.md's table has no row for connector %s", name)
		}
		require.Contains(t, table, code, "connectors.md's table does not name connector %s", name)
		require.Contains(t, field, code, "configuration.md's pools[].connector row does not name connector %s", name)
	}
}

// tableAt returns the table rows of page from the line that starts with
// start to the end of that table.
func tableAt(t *testing.T, page, start string) string {
	t.Helper()
	text := prose(t, page)
	i := strings.Index(text, "\n"+start)
	require.GreaterOrEqual(t, i, 0, "%s has no line starting %q", page, start)
	var rows []string
	for line := range strings.Lines(text[i+1:]) {
		if !strings.HasPrefix(line, "|") {
			break
		}
		rows = append(rows, line)
	}
	return strings.Join(rows, "")
}
