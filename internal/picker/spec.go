package picker

import (
	"fmt"
	"slices"
	"strings"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// Spec is everything pdx knows of a picking policy outside its own file.
// Every policy file has one, and specs lists it: nothing else in pdx
// switches on a policy's name or its parameters.
type Spec struct {
	// Name is the policy's name in pools[].*_picker.policy.
	Name string
	// Fields are the fields of the config's Picker message (proto names,
	// e.g. "weights") that the policy reads; config refuses them on the
	// legs of other policies.
	Fields []string
	// Defaults, when set, fills in the policy's own fields a leg's picker
	// leaves unset.
	Defaults func(p *configv1.Picker, role Role)
	// Validate, when set, checks the values of the policy's own fields;
	// path is the picker's field path, e.g. "pools[0].decode_picker".
	Validate func(p *configv1.Picker, path string) []error
	// New builds the policy of a leg's picker, Defaults applied.
	New func(p *configv1.Picker, role Role) Policy
}

// specs lists every picking policy. Adding one is a file with its type and
// spec, and a line here.
func specs() []Spec {
	return []Spec{
		roundRobinSpec(),
		leastRequestSpec(),
		leastWorkSpec(),
		prefixAffinitySpec(),
		loadAwareSpec(),
		forecastSpec(),
	}
}

// DefaultPolicy returns the policy of a leg whose config names none:
// forecast, which places a prefill by the time its engine's learned
// service model forecasts for the prompt (the work queued there and what
// it has cached), and a decode where its KV has room, then by the prefix
// its engine holds and its batch.
func DefaultPolicy(Role) string { return ForecastPolicy }

// Lookup returns the spec of the policy named name.
func Lookup(name string) (Spec, error) {
	for _, s := range specs() {
		if s.Name == name {
			return s, nil
		}
	}
	return Spec{}, fmt.Errorf("unknown picking policy %q (known: %s)", name, strings.Join(Policies(), ", "))
}

// Policies lists the names of the picking policies, sorted.
func Policies() []string {
	var names []string
	for _, s := range specs() {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	return names
}

// Claimants lists the names of the policies that read field, for
// messages.
func Claimants(field string) []string {
	var names []string
	for _, s := range specs() {
		if slices.Contains(s.Fields, field) {
			names = append(names, s.Name)
		}
	}
	return names
}

// WithDefaults returns p with its policy and the policy's own fields
// filled in where unset (DefaultPolicy of role, the spec's Defaults): p
// itself, or a new Picker when p is nil.
func WithDefaults(p *configv1.Picker, role Role) *configv1.Picker {
	if p == nil {
		p = &configv1.Picker{}
	}
	if p.Policy == "" {
		p.Policy = DefaultPolicy(role)
		if role == RoleDecode && p.Weights != nil {
			// Written for load_aware, the decode leg's default before
			// forecast: the weights are its, and the config keeps working.
			p.Policy = LoadAwarePolicy
		}
	}
	if spec, err := Lookup(p.Policy); err == nil && spec.Defaults != nil {
		spec.Defaults(p, role)
	}
	return p
}
